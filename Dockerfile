# syntax=docker/dockerfile:1
# The epdserve image: one image for every role (router, encoder, serve, up), chosen by the
# command: `docker run IMAGE router ...`. CPU torch by default; for CUDA build with
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# (docs/deploy.md). The embedded model ships inside the package, so the image serves without
# downloading anything.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# torch comes from PyTorch's own index: PyPI's torch wheel is the CUDA build; the CPU index has
# the CPU-only one. The version must stay pyproject.toml's pin (tests/test_deploy.py checks it).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# optional extras, comma-separated: store (Redis), tracing, mooncake
ARG EPD_EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/epdserve
ENV PATH=/opt/epdserve/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY epdserve ./epdserve
# not editable (README's `pip install -e .` is for a checkout): the package, its embedded model
# included, is copied into the venv and /src is left behind in this stage
RUN pip install ".${EPD_EXTRAS:+[$EPD_EXTRAS]}" && epdserve model-path

FROM ${PYTHON_IMAGE}
# a C++ compiler: language-model roles build their fused CPU kernels for the CPU they run on, at
# first start (cached in ~/.cache/epdserve). Without one they run PyTorch ops.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 --user-group epd
COPY --from=build /opt/epdserve /opt/epdserve
ENV PATH=/opt/epdserve/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/epd
# the router's default port; encoders and workers listen where --port says
EXPOSE 8000
# docker's own health check (Kubernetes uses the probes in deploy/k8s): a role on another port
# than 8000 sets EPD_HEALTH_PORT
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('EPD_HEALTH_PORT', '8000'), timeout=4)"
ENTRYPOINT ["epdserve"]
CMD ["--help"]
