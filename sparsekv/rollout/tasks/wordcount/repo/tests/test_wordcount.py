from wordcount import count_words, main


def test_spaces():
    assert count_words("one two three") == 3


def test_whitespace():
    assert count_words("one\ttwo\nthree   four") == 4


def test_empty():
    assert count_words("") == 0


def test_main(tmp_path, capsys):
    f = tmp_path / "a.txt"
    f.write_text("a b\nc\n")
    assert main([str(f)]) == 0
    assert capsys.readouterr().out.strip() == "3"
