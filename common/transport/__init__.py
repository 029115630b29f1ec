"""Transport: TLS and certificates, the wire codec, protocol domain types, gRPC options/errors."""
