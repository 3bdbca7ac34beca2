"""The top package: the `adamspike` command line (study.cli) and the study scheduler
(study.reproduce, its stages in configs/study.toml). It wires the packages below it
(adamspike, theory, simulate, fullscale, analysis, figures); none of them imports it.
`python -m study` is the `adamspike` console script."""
