# syntax=docker/dockerfile:1
# attnserve images (docs/OPERATIONS.md):
#   docker build -t attnserve:gpu .               CUDA provider, fp16 graphs (the default target)
#   docker build -t attnserve:cpu --target cpu .  CPU provider, int8 graphs
# The model baked in is checkpoints/$MODEL_NAME from the build context, exported to ONNX in the
# `export` stage. The runtime images hold a standalone CPython, a venv with what serving imports
# (deploy/docker/requirements-*.txt: no torch, no pip, no compilers) and the one ONNX variant
# they run. They write only under the volume /var/lib/attnserve and are configured by ATTNSERVE_*
# environment variables (README, "HTTP API").

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CPU_BASE_IMAGE=debian:bookworm-slim
# onnxruntime-gpu 1.31 is built for CUDA 13 and cuDNN 9.
ARG CUDA_BASE_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04
ARG MODEL_NAME=ende-small

# ---- export: the project with torch (CPU wheel), the model's ONNX variants, attnserve's wheel
FROM ${PYTHON_IMAGE} AS export
ARG MODEL_NAME
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# The CPU wheel first, so that `pip install .` finds torch==2.13.0 satisfied instead of pulling
# the CUDA build and its libraries from PyPI.
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0
# A C++ compiler builds attnserve's ONNX Runtime kernels into the wheel (attnserve/kernels: one
# copy of each loop per instruction set, chosen at run time, so the wheel runs on any x86-64).
RUN apt-get update -q && apt-get install -y -q --no-install-recommends g++=4:12.2.0-3 \
 && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml setup.py README.md ./
COPY attnserve/ attnserve/
RUN pip install . && pip wheel --no-deps --wheel-dir /wheels .
COPY checkpoints/${MODEL_NAME}/ /build/model/
# A served model directory is the model's files (not its torch weights) and one ONNX variant.
RUN attnserve export /build/model --variants fp32,int8,fp16 \
 && for variant in int8 fp16; do \
      out="/build/serve-${variant}/${MODEL_NAME}"; \
      mkdir -p "${out}/onnx" \
      && find /build/model -maxdepth 1 -type f ! -name model.safetensors -exec cp -t "${out}" {} + \
      && cp -r "/build/model/onnx/${variant}" "${out}/onnx/" \
      || exit 1; \
    done

# ---- venvs: uv installs a standalone CPython (it runs on any glibc base, CUDA's Ubuntu included)
FROM ${PYTHON_IMAGE} AS venv-base
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python UV_PYTHON_PREFERENCE=only-managed \
    UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_NO_CACHE=1
RUN pip install uv==0.13.8 && uv python install 3.11 && uv venv --python 3.11 /opt/venv
COPY deploy/docker/requirements-*.txt /requirements/
COPY --from=export /wheels/ /wheels/

FROM venv-base AS venv-cpu
RUN uv pip install --python /opt/venv -r /requirements/requirements-cpu.txt \
 && uv pip install --python /opt/venv --no-deps /wheels/*.whl

FROM venv-base AS venv-gpu
RUN uv pip install --python /opt/venv -r /requirements/requirements-gpu.txt \
 && uv pip install --python /opt/venv --no-deps /wheels/*.whl

# ---- cpu: onnxruntime, int8 graphs
FROM ${CPU_BASE_IMAGE} AS cpu
ARG MODEL_NAME
RUN groupadd --system --gid 10001 attnserve \
 && useradd --system --uid 10001 --gid 10001 --no-log-init --home-dir /var/lib/attnserve attnserve \
 && install -d -o 10001 -g 10001 /var/lib/attnserve
COPY --from=venv-base /opt/python/ /opt/python/
COPY --from=venv-cpu /opt/venv/ /opt/venv/
COPY --from=export /build/serve-int8/ /opt/attnserve/models/
# ONNX Runtime's telemetry would write HOME/.cache and TMPDIR/.ses (and try to upload).
ENV PATH=/opt/venv/bin:$PATH LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    HOME=/var/lib/attnserve \
    ORT_DISABLE_TELEMETRY=1 \
    ATTNSERVE_MODELS=/opt/attnserve/models/${MODEL_NAME} \
    ATTNSERVE_VARIANT=int8 \
    ATTNSERVE_PROVIDER=cpu \
    ATTNSERVE_HOST=0.0.0.0 \
    ATTNSERVE_PORT=8000
USER 10001:10001
VOLUME ["/var/lib/attnserve"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-m", "attnserve.service.healthcheck", "/healthz"]
# SIGTERM drains for up to ATTNSERVE_DRAIN_SECONDS (30): stop with `docker stop -t 40`.
CMD ["attnserve", "serve", "--no-auto-export"]

# ---- gpu (default): onnxruntime-gpu, fp16 graphs on the CUDA provider
FROM ${CUDA_BASE_IMAGE} AS gpu
ARG MODEL_NAME
RUN groupadd --system --gid 10001 attnserve \
 && useradd --system --uid 10001 --gid 10001 --no-log-init --home-dir /var/lib/attnserve attnserve \
 && install -d -o 10001 -g 10001 /var/lib/attnserve
COPY --from=venv-base /opt/python/ /opt/python/
COPY --from=venv-gpu /opt/venv/ /opt/venv/
COPY --from=export /build/serve-fp16/ /opt/attnserve/models/
ENV PATH=/opt/venv/bin:$PATH LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    HOME=/var/lib/attnserve \
    ORT_DISABLE_TELEMETRY=1 \
    ATTNSERVE_MODELS=/opt/attnserve/models/${MODEL_NAME} \
    ATTNSERVE_VARIANT=fp16 \
    ATTNSERVE_PROVIDER=cuda \
    ATTNSERVE_HOST=0.0.0.0 \
    ATTNSERVE_PORT=8000
USER 10001:10001
VOLUME ["/var/lib/attnserve"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-m", "attnserve.service.healthcheck", "/healthz"]
CMD ["attnserve", "serve", "--no-auto-export"]
