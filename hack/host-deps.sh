#!/usr/bin/env bash
# Installs the Debian packages the privileged tests and the demo use, when they are missing:
# iptables (both the legacy and nft backends) and iproute2; nftables, whose nft command the real
# node's kube-proxy runs; mmdebstrap, which builds the userland of Kubernetes' test images;
# libseccomp-dev, which the real node's runc build needs; and haproxy, the production proxy of
# the HAProxy test image (its service is stopped and disabled: only the binary is used). With
# DETOUR_HOST_DEPS=cluster (make e2e-cluster) also clang and LLVM 19, with which cilium-agent
# compiles its BPF programs at start (Cilium 1.20 needs LLVM 18 or later; its own image has
# 19.1.7); make test and CI do not install them. Needs root to install; without root it only reports what is missing, and the privileged
# tests then skip (or fail, when required).
set -euo pipefail

missing=()
for tool in iptables-legacy-restore iptables-nft-restore ip6tables-legacy-restore ip6tables-nft-restore; do
	command -v "$tool" >/dev/null 2>&1 || PATH=$PATH:/usr/sbin:/sbin command -v "$tool" >/dev/null 2>&1 || missing+=(iptables)
done
command -v ip >/dev/null 2>&1 || PATH=$PATH:/usr/sbin:/sbin command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v nft >/dev/null 2>&1 || PATH=$PATH:/usr/sbin:/sbin command -v nft >/dev/null 2>&1 || missing+=(nftables)
command -v mmdebstrap >/dev/null 2>&1 || missing+=(mmdebstrap)
[ -e /usr/include/seccomp.h ] || missing+=(libseccomp-dev)
# The HAProxy test image carries its binary and libraries (test/images/haproxy.go).
[ -x /usr/sbin/haproxy ] || missing+=(haproxy)
if [ "${DETOUR_HOST_DEPS:-}" = cluster ]; then
	# The agent runs clang from PATH: test/e2e/framework/cilium.go puts /usr/lib/llvm-19/bin first.
	[ -x /usr/lib/llvm-19/bin/clang ] || missing+=(clang-19)
	[ -x /usr/lib/llvm-19/bin/llc ] || missing+=(llvm-19)
	# hack/test-binaries.sh reads Cilium's module with it.
	command -v jq >/dev/null 2>&1 || missing+=(jq)
fi
[ ${#missing[@]} -eq 0 ] && exit 0

pkgs=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')
if [ "$(id -u)" -ne 0 ]; then
	echo "host-deps: missing Debian packages: $pkgs(run as root to install them)" >&2
	exit 0
fi
echo "host-deps: installing $pkgs" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends $pkgs >/dev/null 2>&1 ||
	{ apt-get update >/dev/null && apt-get install -y --no-install-recommends $pkgs >/dev/null; }
case " $pkgs" in
*" haproxy "*)
	if [ -d /run/systemd/system ]; then systemctl disable --now haproxy >/dev/null 2>&1 || true; fi
	;;
esac
