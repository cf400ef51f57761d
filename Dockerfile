# One image for every detour component: the detour CLI (webhook, node agent, repair controller,
# validator) and the detour-cni plugin, which the node agent copies onto each host.
#
#   make image IMAGE=registry.example.com/detour:v0.1.0     (see docs/operations.md)
#
# Both binaries are static (CGO_ENABLED=0) and built by the Makefile's own build target, so the
# image and `make build` use the same flags and embed the same version.
ARG GO_VERSION=1.26

FROM golang:${GO_VERSION}-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=v0.1.0-dev
RUN make build VERSION=${VERSION} BIN=/out

# distroless "static" has no shell, no package manager and runs as UID 65532 by default; the
# node agent's DaemonSet runs it as root to write the host's CNI directories.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/detour /out/detour-cni /opt/detour/bin/
# The injected validator runs `detour validate`: keep detour on PATH.
ENV PATH=/opt/detour/bin:/usr/local/bin:/usr/bin:/bin
USER 65532:65532
ENTRYPOINT ["/opt/detour/bin/detour"]
