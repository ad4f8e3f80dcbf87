"""Building and training the embedded shapes-world model (offline, seeded)."""
