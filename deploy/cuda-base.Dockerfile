# A CUDA runtime base for the GPU variant of the image: NVIDIA's CUDA runtime image plus
# the Python the project pins (3.11, with its venv module) as `python3`. Not buildable on
# the development machines (no image registry there); see deploy/README.md.
#
#   docker build -t hybridflow-cuda-base -f deploy/cuda-base.Dockerfile deploy
#   docker build -t hybridflow-serve:cu128 --build-arg BASE_IMAGE=hybridflow-cuda-base \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04
FROM ${CUDA_IMAGE}

# Ubuntu 22.04's own python3 is 3.10, older than the pinned numpy allows; 3.11 comes from
# its updates and is put first on PATH as python3 (the system's python3 stays as it is).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && ln -s /usr/bin/python3.11 /usr/local/bin/python3

ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
