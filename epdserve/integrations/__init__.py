"""Integrations of epdserve with other serving engines (each optional, each in its own subpackage)."""
