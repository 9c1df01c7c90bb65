from streamtrain.cli import program

raise SystemExit(program())
