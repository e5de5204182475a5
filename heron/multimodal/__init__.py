"""Images in, text out: multimodal inputs, their processing and the encoder cache."""
