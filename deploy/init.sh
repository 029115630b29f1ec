#!/bin/sh
# One-shot set-up for the compose simulation: the federation's certificates and demo data.
# Idempotent: an existing CA or dataset is kept, so `docker compose up` can be re-run.
set -eu

if [ ! -f /pki/ca.pem ]; then
    dpfed certs init --out /pki --coordinator-host coordinator \
        --sites hospital-a,hospital-b,hospital-c --analysts analyst
fi

if [ ! -f /data/schema.toml ]; then
    dpfed demo-data --out /data --sites 3 --rows 20000 --features 20 --seed 7
fi
