"""Model code of our own: one file per architecture, a registry from config.json's architectures."""
