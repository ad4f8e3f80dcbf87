"""Media handling: decoding, preprocessing (resize + patchify) and content hashing."""
