# vLLM's image with epdserve installed, for the vLLM language-model workers of
# deploy/k8s/overlays/e-vllm (docs/vllm.md): the connector runs inside vLLM's process.
#   docker build -f deploy/vllm.Dockerfile -t epdserve-vllm:0.1.0 .
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
COPY pyproject.toml README.md /src/
COPY epdserve /src/epdserve
# the [vllm] extra accepts the vLLM, torch and transformers the image already has
RUN pip install --no-cache-dir "/src[vllm]"
RUN useradd --uid 10001 --create-home epd
USER 10001
ENTRYPOINT ["vllm"]
