"""Data at a site: the federation schema, data sources, encoding and the demo data generator."""
