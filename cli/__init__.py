"""The entry points' command lines, kept apart so each entry point reads as what it runs:
generate.py's flags (generate_flags.py) and its speculative decoding run (speculate.py).
"""
