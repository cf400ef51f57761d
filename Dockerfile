# One image for every detour component: the detour CLI (webhook, node agent, repair controller,
# validator) and the detour-cni plugin, which the node agent copies onto each host.
#
# `make image` builds this same image without a Docker engine (internal/image, DetourSpec);
# this Dockerfile is for people who build with Docker:
#
#   make docker-image IMAGE=registry.example.com/detour:v0.1.0     (see docs/operations.md)
#
# Both binaries are static (CGO_ENABLED=0) and built by the Makefile's own build target, so the
# image and `make build` use the same flags and embed the same version. The final stage must
# describe the image DetourSpec does (files, user, entrypoint, PATH, labels): a test in
# internal/image compares them.
ARG GO_VERSION=1.26

FROM golang:${GO_VERSION}-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=v0.2.0-dev
RUN make build VERSION=${VERSION} BIN=/out

# Nothing but the two static binaries and the users root and nonroot (65532): no shell, no
# package manager. The node agent's DaemonSet runs it as root to write the host's CNI
# directories.
FROM scratch
ARG VERSION=v0.1.0-dev
COPY internal/image/rootfs/etc/passwd internal/image/rootfs/etc/group /etc/
COPY --from=build /out/detour /out/detour-cni /opt/detour/bin/
# The injected validator runs `detour validate`: keep detour on PATH.
ENV PATH=/opt/detour/bin:/usr/local/bin:/usr/bin:/bin
USER 65532:65532
ENTRYPOINT ["/opt/detour/bin/detour"]
LABEL org.opencontainers.image.title="detour" \
      org.opencontainers.image.description="detour: mesh traffic capture by a chained CNI plugin and an injection webhook" \
      org.opencontainers.image.source="https://github.com/detourmesh/detour" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
