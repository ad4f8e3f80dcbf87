"""Leaf modules every layer of epdserve may import (models, engine, transfer, the front end):
they import nothing from epdserve outside ``common``, so they can never close an import cycle."""
