"""corral: a self-hosted, OpenAI-compatible inference server for constrained decoding.

The one import name the distribution installs. Its packages keep the layout's names one level down:
`corral.server` (HTTP, OpenAI API, engine, models), `corral.grammars` (request → grammar spec),
`corral.grammar_engines` (backends, compilation, the sandbox), `corral.structured` (the structured-output wing),
`corral.benchmarks` (`corral bench`), `corral.mediation` (client side).
Importing `corral` alone loads nothing heavy: `corral.mediation` stays usable without torch.
"""
