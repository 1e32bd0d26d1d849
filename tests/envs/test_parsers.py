import pytest

from tandem.envs import Parser, ThinkParser, XMLParser


def turns(*contents: str) -> list[dict]:
    messages = []
    for content in contents:
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "ok"}]
    return messages[:-1]


def test_parser_takes_the_last_assistant_message():
    parser = Parser()
    assert parser.parse_answer(turns("first", "second")) == "second"
    assert parser.parse_answer("plain text") == "plain text"
    assert parser.parse_answer([{"role": "user", "content": "hi"}]) is None
    assert parser.get_format_reward_func()(turns("x")) == 1.0


def test_xml_parser_reads_fields():
    parser = XMLParser(["think", "answer"])
    parsed = parser.parse("<think> hmm </think>\n<answer>1</answer> <answer>\n2\n</answer>")
    assert (parsed.think, parsed.answer) == ("hmm", "2")
    assert parser.parse("<answer>unclosed").answer is None
    assert parser.parse_answer(turns("<answer>a</answer>", "<answer>b</answer>")) == "b"
    assert parser.parse_answer([]) is None
    assert XMLParser(["a", "b"], answer_field="a").answer_field == "a"


def test_xml_parser_format_round_trips():
    parser = XMLParser(["think", "answer"])
    text = parser.format(think="steps", answer="42")
    assert text == "<think>\nsteps\n</think>\n<answer>\n42\n</answer>"
    assert parser.parse(text).answer == "42"
    with pytest.raises(ValueError, match="unknown fields"):
        parser.format(verdict="x")


def test_xml_parser_refuses_bad_fields():
    with pytest.raises(ValueError, match="answer_field"):
        XMLParser(["a"], answer_field="b")
    with pytest.raises(ValueError, match="not a valid tag name"):
        XMLParser(["a b"])


def test_xml_format_reward():
    reward = XMLParser(["answer"]).get_format_reward_func()
    assert reward(turns("<answer>x</answer>")) == 1.0
    assert reward(turns("so: <answer>x</answer>")) == 0.75
    assert reward(turns("<answer>x</answer><answer>y</answer> done")) == 0.5
    assert reward(turns("x")) == 0.0
    assert reward(turns("<answer> </answer>")) == 0.0
    assert reward(turns("<answer>x</answer>", "x")) == 0.5
    assert reward([]) == 0.0


def test_think_parser_drops_reasoning():
    parser = ThinkParser()
    assert parser.parse("<think>a</think> answer ") == "answer"
    assert parser.parse("<think>still going") == ""
    assert parser.parse("no tags") == "no tags"
    assert ThinkParser(extract_fn=str.upper).parse_answer(turns("<think>x</think>yes")) == "YES"


def test_think_format_reward():
    reward = ThinkParser().get_format_reward_func()
    assert reward(turns("<think>r</think>answer")) == 1.0
    assert reward(turns("answer")) == 0.0
    assert reward(turns("<think>r</think>")) == 0.0
    assert reward(turns("<think>a</think><think>b</think>c")) == 0.0
    assert reward(turns("<think>r</think>a", "b")) == 0.5
