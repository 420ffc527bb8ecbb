"""Stage 2 and 3: baseline models (`quantize.models`), and in later issues the formats,
the llmcompressor backend, byte accounting and decode-time bounds."""
