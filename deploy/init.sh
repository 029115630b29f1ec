#!/bin/sh
# One-shot set-up for the compose federation: certificates, demo data, and one volume per
# service holding only that service's files. Idempotent: an existing CA or dataset is kept,
# so `docker compose up` can be re-run.
#
# $CA_DIR (the `ca` volume) and $DEMO_DIR (`demo-data`) are mounted by this step only: the CA
# private key never leaves it. Under $OUT_DIR each service's volume receives its own kit:
#   coordinator-kit   coordinator.pem/.key, ca.pem, access.toml and the federation's schema
#   hospital-X-kit    that hospital's site.pem/.key, ca.pem, revoked.toml
#   hospital-X-data   the federation's schema and that hospital's table (site.csv)
#   analyst-kit       the analyst's certificate and key, ca.pem
# Run as root, it gives the files to the image's runtime user ($RUN_UID); keys stay 0600.
# (The variables exist so the tests can play this script outside Docker.)
set -eu

CA_DIR="${CA_DIR:-/ca}"
DEMO_DIR="${DEMO_DIR:-/demo-data}"
OUT_DIR="${OUT_DIR:-/out}"
DEMO_ROWS="${DEMO_ROWS:-20000}"
RUN_UID="${RUN_UID:-10001}"

if [ ! -f "$CA_DIR/ca.pem" ]; then
    dpfed certs init --out "$CA_DIR" --coordinator-host coordinator \
        --sites hospital-a,hospital-b,hospital-c --analysts analyst
fi
if [ ! -f "$DEMO_DIR/schema.toml" ]; then
    dpfed demo-data --out "$DEMO_DIR" --sites 3 --rows "$DEMO_ROWS" --features 20 --seed 7
fi

# publish VOLUME FILE...: replace the volume's content with these files (folders: their content)
publish() {
    volume="$OUT_DIR/$1"
    shift
    find "$volume" -mindepth 1 -delete
    for src in "$@"; do
        if [ -d "$src" ]; then cp -Rp "$src/." "$volume/"; else cp -p "$src" "$volume/"; fi
    done
    if [ "$(id -u)" = 0 ]; then chown -R "$RUN_UID:$RUN_UID" "$volume"; fi
}

publish coordinator-kit "$CA_DIR/coordinator" "$DEMO_DIR/schema.toml"
publish analyst-kit "$CA_DIR/analysts/analyst"
n=1
for site in hospital-a hospital-b hospital-c; do
    publish "$site-kit" "$CA_DIR/sites/$site"
    publish "$site-data" "$DEMO_DIR/schema.toml" "$DEMO_DIR/site_0$n.csv"
    mv "$OUT_DIR/$site-data/site_0$n.csv" "$OUT_DIR/$site-data/site.csv"
    n=$((n + 1))
done
