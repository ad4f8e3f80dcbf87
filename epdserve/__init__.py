"""epdserve: disaggregated Encode / Prefill / Decode serving for multimodal language models."""

__version__ = "0.1.0"
