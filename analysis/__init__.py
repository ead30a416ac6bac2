"""Global analysis of the whole-model TE program."""
