"""Stage 3: measure. Byte accounting of a checkpoint from its safetensors headers (`measure`),
the 4.15-bit comparison and the decode-time lower bounds its bytes imply (`bounds`)."""
