# trajproxy itself. `docker compose up` runs it with Postgres; see docker-compose.yml.
FROM python:3.11-slim
WORKDIR /app
# Its dependencies first, read from pyproject.toml alone: a layer that a change to trajproxy's code leaves as it was
# (a rebuild after one takes seconds, not the minute of installing them all again).
COPY pyproject.toml ./
RUN python3 -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
        >/tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt && rm -rf /root/.cache /tmp/requirements.txt
COPY README.md ./
COPY proxy proxy
COPY sandbox sandbox
COPY integrations integrations
RUN pip install --no-cache-dir --no-deps . && rm -rf /root/.cache
ENV TRAJPROXY_HOST=0.0.0.0 \
    TRAJPROXY_SOCKET_PATH=/run/trajproxy/proxy.sock \
    PYTHONUNBUFFERED=1
EXPOSE 8000
HEALTHCHECK --interval=5s --timeout=3s --retries=20 \
    CMD python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"
CMD ["trajproxy", "serve"]
