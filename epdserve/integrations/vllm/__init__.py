"""epdserve's encoders in front of vLLM language-model instances.

``ec_connector`` is a vLLM EC connector (loaded by ``vllm serve --ec-transfer-config`` through
``ec_connector_module_path``) that takes each media item's embeddings from epdserve's encoders by
signed handle instead of running vLLM's vision tower; ``config`` and ``handles`` are its parts that
need neither vLLM nor torch. Nothing here is imported by the rest of the package.
"""
