"""`corral bench kinds`: per-token mask cost of each grammar backend on regexes, grammars and choices, the numbers
`auto`'s order for those kinds rests on (corral/grammar_engines/backends/)."""
