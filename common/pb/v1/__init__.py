"""Generated protobuf code (see proto/)."""
