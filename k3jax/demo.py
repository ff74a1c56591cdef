"""`make demo`: runs the ops on a small problem and prints what they computed."""


def main() -> None:
  print("k3jax demo: the ops land in [1/9]")


if __name__ == "__main__":
  main()
