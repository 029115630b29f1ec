#!/bin/sh
# One-shot set-up for the compose simulation: the federation's certificates and demo data.
# Idempotent: an existing CA or dataset is kept, so `docker compose up` can be re-run.
#
# The CA (with its private key) lives in $CA_DIR, a volume only this init step mounts; the
# other containers mount $PKI_DIR, which receives the CA certificate and the kits but never
# ca.key. (The variables exist so the tests can play this script outside Docker.)
set -eu

CA_DIR="${CA_DIR:-/ca}"
PKI_DIR="${PKI_DIR:-/pki}"
DATA_DIR="${DATA_DIR:-/data}"
DEMO_ROWS="${DEMO_ROWS:-20000}"

if [ ! -f "$CA_DIR/ca.pem" ]; then
    dpfed certs init --out "$CA_DIR" --coordinator-host coordinator \
        --sites hospital-a,hospital-b,hospital-c --analysts analyst
fi

# Publish everything but the CA private key.
cp -p "$CA_DIR/ca.pem" "$PKI_DIR/ca.pem"
for kind in coordinator sites analysts; do
    rm -rf "${PKI_DIR:?}/$kind"
    cp -Rp "$CA_DIR/$kind" "$PKI_DIR/$kind"
done
rm -f "$PKI_DIR/ca.key"

if [ ! -f "$DATA_DIR/schema.toml" ]; then
    dpfed demo-data --out "$DATA_DIR" --sites 3 --rows "$DEMO_ROWS" --features 20 --seed 7
fi
