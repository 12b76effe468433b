#!/usr/bin/env python3
"""A test key pair, its JWKS and a signed JWT, for trying `[[auth.jwt]]` (docs/consumers.md).

    python3 examples/make-jwt.py --dir DIR --iss https://idp.example.com/ --aud api \\
        --sub acme [--claim plan=gold] [--ttl 3600] > token

Writes DIR/jwt-key.pem (an RSA 2048 private key, mode 0600, made once and reused),
DIR/jwks.json (its public key, `kid` "test-1", for `jwks_file`) and prints an RS256 token
with `iss`, `aud`, `sub`, `iat`, `exp` (now + ttl) and each `--claim NAME=VALUE` (a value
that is a JSON number stays one). openssl and Python's standard library only. For tests:
a real issuer keeps its private key to itself.
"""

import argparse
import base64
import json
import os
import re
import subprocess
import sys
import time


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def openssl(*args, data=None):
    return subprocess.run(["openssl", *args], input=data, capture_output=True, check=True).stdout


def public_numbers(key):
    """The modulus and public exponent of the RSA key in PEM file `key`."""
    text = openssl("rsa", "-in", key, "-noout", "-text").decode()
    hexdump = text.split("modulus:")[1].split("publicExponent:")[0]
    n = bytes.fromhex(re.sub(r"[\s:]", "", hexdump)).lstrip(b"\0")
    e = int(re.search(r"publicExponent: (\d+)", text).group(1))
    return n, e.to_bytes((e.bit_length() + 7) // 8, "big")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="where jwt-key.pem and jwks.json go")
    ap.add_argument("--iss", required=True)
    ap.add_argument("--aud", required=True)
    ap.add_argument("--sub", required=True)
    ap.add_argument("--claim", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--ttl", type=int, default=3600, help="seconds until exp")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    key = os.path.join(args.dir, "jwt-key.pem")
    if not os.path.exists(key):
        pem = openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
    n, e = public_numbers(key)
    jwk = {"kty": "RSA", "kid": "test-1", "alg": "RS256", "use": "sig", "n": b64url(n), "e": b64url(e)}
    with open(os.path.join(args.dir, "jwks.json"), "w") as f:
        json.dump({"keys": [jwk]}, f, indent=2)
        f.write("\n")
    now = int(time.time())
    claims = {"iss": args.iss, "aud": args.aud, "sub": args.sub, "iat": now, "exp": now + args.ttl}
    for c in args.claim:
        name, _, value = c.partition("=")
        claims[name] = int(value) if re.fullmatch(r"-?\d+", value) else value
    header = {"alg": "RS256", "typ": "JWT", "kid": "test-1"}
    signing_input = ".".join(
        b64url(json.dumps(p, separators=(",", ":")).encode()) for p in (header, claims)
    )
    signature = openssl("dgst", "-sha256", "-sign", key, data=signing_input.encode())
    print(f"{signing_input}.{b64url(signature)}")


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as e:
        sys.exit(f"openssl failed: {e.stderr.decode()}")
