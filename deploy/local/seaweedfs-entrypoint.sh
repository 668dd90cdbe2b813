#!/bin/sh
# SeaweedFS as an S3 server on :9000 with one identity, the deployment's S3 credentials, under /data
set -eu
: "${MARLAAS_S3_ACCESS_KEY:?set MARLAAS_S3_ACCESS_KEY}" "${MARLAAS_S3_SECRET_KEY:?set MARLAAS_S3_SECRET_KEY}"
mkdir -p /data
cat > /tmp/s3.json <<JSON
{"identities": [{"name": "marlaas",
  "credentials": [{"accessKey": "$MARLAAS_S3_ACCESS_KEY", "secretKey": "$MARLAAS_S3_SECRET_KEY"}],
  "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}
JSON
exec weed server -dir=/data -ip.bind=0.0.0.0 -master.volumeSizeLimitMB=256 -volume.max=0 \
    -s3 -s3.port=9000 -s3.config=/tmp/s3.json "$@"
