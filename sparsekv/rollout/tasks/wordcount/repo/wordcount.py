"""Count the words of files or standard input."""
import argparse
import sys


def count_words(text: str) -> int:
    return len(text.split(" "))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="wordcount")
    p.add_argument("files", nargs="*")
    args = p.parse_args(argv)
    texts = [open(f).read() for f in args.files] or [sys.stdin.read()]
    print(sum(count_words(t) for t in texts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
