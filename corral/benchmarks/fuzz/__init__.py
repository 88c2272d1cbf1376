"""`corral bench fuzz`: schemathesis-generated requests against a corral, judged by one oracle."""
