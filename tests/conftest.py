pytest_plugins = ["baton_testing.s3", "baton_testing.cluster", "baton_testing.operator_fixtures"]
