# The compose scale profile's load balancer: HAProxy from Debian's packages, its config from deploy/haproxy/.
FROM python:3.11-slim
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends haproxy \
    && rm -rf /var/lib/apt/lists/*
COPY haproxy/defaults.cfg haproxy/compose.cfg /etc/haproxy/trajproxy/
RUN mkdir -p /run/balancer /run/replicas /run/trajproxy \
    && haproxy -c -f /etc/haproxy/trajproxy/defaults.cfg -f /etc/haproxy/trajproxy/compose.cfg
EXPOSE 8080
HEALTHCHECK --interval=2s --timeout=3s --retries=30 \
    CMD python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=2)"
# -W: master-worker, which restarts nothing but forwards signals; -db: stay in the foreground, warnings on stderr
CMD ["haproxy", "-W", "-db", "-f", "/etc/haproxy/trajproxy/defaults.cfg", "-f", "/etc/haproxy/trajproxy/compose.cfg"]
