from megatrain_cli.cli import main

main()
