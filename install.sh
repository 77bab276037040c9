#!/usr/bin/env bash
# Install DSec on a fresh Debian 12 machine, as a node runs it: the system packages its plugins
# need, then the kernel with its server extra (nats-server, bcrypt, gRPC) and every in-repo
# plugin (editable, with the test tools). A trainer needs only `pip install dsec-kernel`.
# Idempotent; a second run with nothing changed takes about a second. PYTHON picks the
# interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

apt_packages=(libseccomp2 iproute2 procps erofs-utils btrfs-progs busybox-static debootstrap gcc libc6-dev
              nftables bubblewrap crun)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "install: apt-get install ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi

plugins=(plugins/*/)
stamp=.install-stamp
# what was installed, and into which interpreter's environment
want=$( { cat install.sh pyproject.toml "${plugins[@]/%/pyproject.toml}"; "$PY" -c 'import sys
print(sys.prefix)'; } | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && "$PY" -c "import sys, dsec_kernel.cli, dsec_backend_fncall.backend, pytest
from dsec_kernel.cli.extras import server_extra_hint
sys.exit(not dsec_kernel.__file__.startswith('$PWD/') or server_extra_hint('up') is not None)" \
     2>/dev/null \
   && command -v dsec >/dev/null; then
  echo "install: up to date"
  exit 0
fi
args=(-e ".[server,test,fast]")
for p in "${plugins[@]}"; do args+=(-e "$p"); done
echo "install: pip install ${args[*]}"
# one line per step pip takes (a fresh venv takes ~40 s), its whole output kept for a failure
log=$(mktemp)
if ! "$PY" -m pip install --progress-bar off --disable-pip-version-check --root-user-action=ignore \
     "${args[@]}" 2>&1 | tee "$log" \
     | { grep --line-buffered -E '^(Obtaining|Collecting|Building|Installing|Successfully)' || true; } \
     | sed -u 's/^/install: pip: /'; then
  echo "install: pip failed; its output:" >&2; tail -40 "$log" >&2; rm -f "$log"; exit 1
fi
rm -f "$log"
command -v pyenv >/dev/null && pyenv rehash || true
echo "$want" > "$stamp"
echo "install: done ($("$PY" -m dsec_kernel.cli --version))"
