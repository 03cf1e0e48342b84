# tinyserve with GPU passthrough:
#   docker build -t tinyserve .
#   docker run --gpus all -p 8000:8000 -v hf:/data/hf -v kernels:/data/kernels tinyserve \
#       run Qwen/Qwen3.5-35B-A3B --kv iso3 --gpu-memory 6GiB --host 0.0.0.0
# No CUDA toolkit in the image: the project's CUDA kernels compile at first use with the NVRTC
# of torch's CUDA wheel, for whatever GPU is passed through (cached in /data/kernels); Triton
# builds its launcher with gcc once.
ARG CUDA_VERSION=12.8.1
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu24.04

ARG TORCH_VERSION=2.9.1

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/data/hf \
    TINYSERVE_CACHE_DIR=/data/kernels \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch from PyPI is the CUDA 12.8 build on x86-64 Linux.
RUN pip install "torch==${TORCH_VERSION}"

WORKDIR /opt/tinyserve
COPY pyproject.toml README.md ./
COPY tinyserve ./tinyserve
RUN pip install ".[gpu]"

RUN useradd --create-home --uid 1000 tinyserve \
    && mkdir -p /data/hf /data/kernels \
    && chown -R tinyserve:tinyserve /data
USER 1000:1000
VOLUME ["/data/hf", "/data/kernels"]

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["tinyserve"]
CMD ["demo", "--host", "0.0.0.0"]
