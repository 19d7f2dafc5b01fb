from flashgen.cli import main

main()
