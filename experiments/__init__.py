"""Study specs (YAML in this folder): the schema, validation and expansion into runs."""
