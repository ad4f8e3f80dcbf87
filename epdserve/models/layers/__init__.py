"""The building blocks every model family shares; a family file holds only what differs.

``norm`` (RMSNorm), ``rotary`` (M-RoPE for the language model, 2-D rotary for vision towers),
``activation`` (names from config.json), ``attention`` and ``mlp`` (a decoder layer's halves),
``decoder`` (the decoder layer and the language model built from it), ``vision`` (patch
embedding, vision attention, block and merger).
"""
