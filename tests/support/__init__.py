"""What tests share: schemas, in-memory site tables, extreme-record builders."""
