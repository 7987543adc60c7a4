"""The bundled topic corpus: a seeded, generated 4-class text set, no files needed.

Four topics (sky, kitchen, sport, money) each own a word list, written for pipetune,
and all share a list of common words. A document of 12-40 words draws each word
from the common list (Zipf-like weights, rank ``r`` weighted ``1 / r``) with
probability 0.7, otherwise from a topic's list (weights ``1 / r ** 0.9``): its own
topic with probability 0.7, another topic otherwise. A few "bridge" words belong to
two topics, and 5% of the documents carry a random wrong label, so the task is
learnable but not trivial: a text CNN gets well above chance within a few epochs and
cannot reach 100%.

Generation uses :class:`random.Random` seeded with a string, whose stream Python
keeps stable across versions, so the same ``seed`` always gives the same corpus.
Training and validation documents come from separate streams: changing the number
of training documents leaves the validation set unchanged.
"""

from __future__ import annotations

import bisect
import itertools
import random

TOPICS: tuple[str, ...] = ("sky", "kitchen", "sport", "money")

COMMON_WORDS: tuple[str, ...] = tuple(
    """
    the of and a to in is that it for was on with as by at this from they we be have
    are or not but all one new more some there about after first two year people day
    week said says just also over many most other like could would should will can may
    make made take took good great small large long little next last still well very
    much part way report news local world group place number plan work start end today
    yesterday morning night early late city country area idea question change thing
    point result reason story open close show look found find give went come see known
    called between during while because though every each few several another both
    around against under without again three four half hour hours month months whole
    nearly almost often always never perhaps quite rather already soon later others
    """.split()
)

TOPIC_WORDS: dict[str, tuple[str, ...]] = {
    "sky": tuple(
        """
        orbit planet telescope comet galaxy nebula asteroid rocket satellite astronaut
        lunar solar crater eclipse meteor stars cosmic gravity spacecraft probe
        observatory jupiter saturn mars venus moon sun universe launch supernova
        radiation atmosphere capsule payload cosmonaut constellation spectrum infrared
        record distance temperature mass orbital horizon
        """.split()
    ),
    "kitchen": tuple(
        """
        recipe oven flour butter garlic onion simmer bake roast sauce pepper salt sugar
        dough bread soup skillet knife chop stir boil fry herbs basil tomato cheese
        pasta chef dinner dessert vinegar lemon ginger broth whisk batter spoon taste
        flavor grill serve heat temperature mix plate
        """.split()
    ),
    "sport": tuple(
        """
        match goal coach league season player players striker keeper referee stadium
        fans tournament championship final penalty inning pitcher tackle sprint
        marathon medal relay captain defender midfield victory defeat playoff trophy
        halftime overtime rebound dribble racket umpire squad kickoff record rally
        serve lead team distance
        """.split()
    ),
    "money": tuple(
        """
        market stocks shares investor investors bank interest inflation bond bonds
        dividend profit revenue earnings quarter budget loan credit debt currency
        dollar euro trader trading fund portfolio merger acquisition equity tax economy
        recession price prices exchange deposit mortgage audit lender launch rally gain
        lead venture plate
        """.split()
    ),
}

TOPIC_RATE = 0.3
OWN_TOPIC_RATE = 0.7
LABEL_NOISE = 0.05
MIN_WORDS, MAX_WORDS = 12, 40


def _cumulative(n: int, exponent: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (rank**exponent) for rank in range(1, n + 1)))


_COMMON_CUM = _cumulative(len(COMMON_WORDS), 1.0)
_TOPIC_CUM = {t: _cumulative(len(w), 0.9) for t, w in TOPIC_WORDS.items()}


def _pick(rng: random.Random, words: tuple[str, ...], cum: list[float]) -> str:
    return words[bisect.bisect_right(cum, rng.random() * cum[-1])]


def _document(rng: random.Random, topic: int) -> str:
    length = rng.randint(MIN_WORDS, MAX_WORDS)
    words: list[str] = []
    for _ in range(length):
        if rng.random() < TOPIC_RATE:
            source = topic
            if rng.random() >= OWN_TOPIC_RATE:
                source = rng.choice([t for t in range(len(TOPICS)) if t != topic])
            name = TOPICS[source]
            words.append(_pick(rng, TOPIC_WORDS[name], _TOPIC_CUM[name]))
        else:
            words.append(_pick(rng, COMMON_WORDS, _COMMON_CUM))
    sentences = []
    while words:
        cut = rng.randint(6, 14)
        sentence, words = words[:cut], words[cut:]
        sentences.append(" ".join(sentence).capitalize() + ".")
    return " ".join(sentences)


def topic_corpus(n: int, seed: int = 0, split: str = "train") -> tuple[list[str], list[int]]:
    """``n`` documents of the bundled corpus and their labels (0..3, see :data:`TOPICS`).

    Documents cycle through the topics, so the classes are balanced. ``split`` names
    an independent stream (``"train"`` and ``"val"``).
    """
    rng = random.Random(f"pipetune-topic-corpus:{seed}:{split}")
    texts: list[str] = []
    labels: list[int] = []
    for i in range(n):
        topic = i % len(TOPICS)
        texts.append(_document(rng, topic))
        label = topic
        if rng.random() < LABEL_NOISE:
            label = rng.choice([t for t in range(len(TOPICS)) if t != topic])
        labels.append(label)
    return texts, labels
