# loragate: one image for the gateway, the workers and the one-shot model build.
# Installs the project exactly as the README does (pip, with the CPU torch wheel pinned in pyproject.toml).
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 LORAGATE_CACHE=/models LORAGATE_KERNEL_CACHE=/models/kernels
# g++ also builds the native CPU kernels on a worker's first start (kernels/native.py), cached in the models volume.
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ make && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY loragate ./loragate
COPY gateway ./gateway
COPY worker ./worker
COPY kernels ./kernels
COPY policies ./policies
COPY loadtest ./loadtest
RUN python3 -m pip install --extra-index-url https://download.pytorch.org/whl/cpu -e .

EXPOSE 8000 9100
ENTRYPOINT ["loragate"]
CMD ["--help"]
