# One image for every glmserve service (router, prefill, decode, kvstore); docker-compose.yml picks
# the command. No model is baked in or downloaded: mount a model directory read-only at run time.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    NIXL_LOG_LEVEL=WARN

WORKDIR /app

# The pinned CPU torch first: an unpinned or CUDA-index torch pulls a multi-GB CUDA build, and
# installing it before the package keeps this layer cached when only the code changes.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

# g++ builds the native kernels (glmserve/model/native_kernels.py); without it the
# same selection runs in slower torch ops.
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# Only what the install needs: the generated gRPC code is committed under glmserve/proto_gen.
COPY pyproject.toml README.md ./
COPY glmserve ./glmserve
RUN pip install . && python -c "import glmserve.services.router.main, glmserve.services.kvstore.main"

# The kernels are compiled into the image; the services' user takes the build lock when it loads it.
ENV TORCH_EXTENSIONS_DIR=/app/torch_extensions
RUN useradd --system --uid 10001 --no-create-home glmserve \
    && python -m glmserve.model.native_kernels && chown -R glmserve /app/torch_extensions
USER glmserve

# router HTTP, prefill gRPC, decode gRPC, kvstore gRPC, metrics
EXPOSE 8000 50061 50062 50070 9100
CMD ["glmserve", "--help"]
