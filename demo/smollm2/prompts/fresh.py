"""The fresh-subject part of the head-training prompts (ids `fresh-NNNN` in train.jsonl), written for the project.

A fine-tune of the committed head on every answer it had seen raised its agreement on held-out prompts of the
training subjects by ~3 points but tau on the head-selection prompts (subjects absent from training) by 0.5%: what
generalises is breadth of subject, not more passes over the same ones. These prompts are chat prose and a little
code on subjects none of the earlier prompts name: each subject below is dropped if any earlier training prompt
already contains it, and no subject may touch the benchmark's, calibration or head-selection prompts (broad.py's
`EXCLUDED` and `SELECTION_EXCLUDED` here, checked against those files by tests/test_prompt_sets.py), so the
head-selection prompts stay a fair test of new subjects. Each category gets a quota, drawn deterministically.

    python demo/smollm2/prompts/fresh.py          # rewrites the fresh-* lines of train.jsonl (idempotent)
"""

from __future__ import annotations

import random
from pathlib import Path

import broad  # the sibling script (its directory is sys.path[0] when run by path; the tests add it)

HERE = Path(__file__).resolve().parent
SEED = 20261205
SOURCE = "spectree project (templated, fresh subjects: demo/smollm2/prompts/fresh.py)"
PREFIX = "fresh-"

# Words of the head-selection prompts' subjects (prompts/head-selection.jsonl): none of these prompts may use them.
SELECTION_EXCLUDED = [
    "fizzbuzz", "swap", "dataclass", "http server", "word count", "like wc", "hashmap", "merge sort", "quicksort",
    "countdown",
    "enum", "goroutine", "channel", "promise", "makefile", "yaml", "context manager", "generic", "origami", "crane",
    "typewriter", "compost", "tea ceremony", "mushroom", "carpool", "knit", "saxophone", "subway", "umbrella",
    "aurora", "northern lights", "sloth", "hiccup", "landlord", "tap", "marathon", "glassblow", "venice",
    "daylight saving",
]

EXPLAIN = [  # things and ideas to explain
    "how a lock and key work", "how a zipper works", "how a bicycle's gears work", "how a parachute slows a fall",
    "how a hot air balloon rises", "how a submarine dives and surfaces", "how a pendulum clock keeps time",
    "how a compass finds north", "how a camera lens focuses", "how a microwave oven heats food",
    "how a refrigerator keeps food cold", "how a dishwasher cleans plates", "how a vending machine checks coins",
    "how a traffic light knows when to change", "how an elevator is kept safe", "how an escalator works",
    "how a wind turbine makes electricity", "how a dam produces power", "how a sailboat can sail against the wind",
    "how a helicopter stays in the air", "how a canal lock lifts a boat", "how a lighthouse lens works",
    "how a barcode scanner reads a label", "how a smoke detector works", "how a fire extinguisher works",
    "how a seismograph records earthquakes", "how a barometer predicts weather", "how glass is made",
    "how paper is recycled", "how cheese is made", "how chocolate is made from cacao beans", "how salt is harvested",
    "how honey is made by bees", "how silk is produced", "how wool becomes yarn", "how leather is tanned",
    "how bricks are made", "how concrete hardens", "how steel is made", "how a pencil is made",
    "how maple syrup is collected", "how olive oil is pressed", "how rice is grown", "how coffee beans are roasted",
    "how a vaccine trains the immune system", "how the kidneys filter blood", "how the ear hears sound",
    "how the eye sees colour", "how muscles get stronger", "how bones heal after a break", "how taste buds work",
    "how fingerprints form", "why we yawn", "why onions make people cry", "why cats purr", "why dogs wag their tails",
    "why leaves change colour in autumn", "why the sky is blue", "why the sea is salty", "why ice floats",
    "why bread goes stale", "why popcorn pops", "why metal feels colder than wood", "why soap removes grease",
    "why some animals hibernate", "why birds migrate", "why zebras have stripes", "why octopuses change colour",
    "why owls can turn their heads so far", "why camels can go without water", "why flamingos are pink",
    "why some trees lose their leaves and others do not", "why cacti have spines", "why rivers meander",
    "why deserts are cold at night", "why lightning comes before thunder", "why rainbows are curved",
    "why hurricanes spin", "why fog forms", "why glaciers move", "why coral reefs are in danger",
    "why bees are important for farming", "why earthworms help soil", "why the Dead Sea is so salty",
    "what a black hole is", "what a comet is made of", "what a light year measures", "what causes a solar eclipse",
    "what a supernova is", "what dark matter is", "what the Milky Way looks like from outside",
    "what an atom is made of", "what a chemical reaction is", "what friction is", "what inertia means",
    "what electric current is", "what magnetism is", "what sound waves are", "what photosynthesis is",
    "what DNA does", "what a cell membrane does", "what an ecosystem is", "what a food chain is",
    "what erosion is", "what plate tectonics is", "what a fossil is", "what an aquifer is", "what a delta is",
    "what inflation is", "what interest on a loan is", "what a stock is", "what supply and demand means",
    "what a trade deficit is", "what a central bank does", "what insurance is for", "what a pension is",
    "what a cooperative is", "what a patent protects", "what copyright covers", "what a jury does",
    "what a constitution is", "what a referendum is", "what a census counts", "what an embassy does",
    "what a mayor does", "what the United Nations does", "what a sonnet is", "what a haiku is",
    "what an orchestra conductor does", "what jazz improvisation is", "what the Renaissance was",
    "what Impressionism is", "what Gothic architecture looks like", "what a mosaic is", "what calligraphy is",
    "what a documentary film is", "what a podcast is", "what a library catalogue does",
    "what a dictionary entry contains",
    "what a prime number is", "what a fraction is", "what probability means", "what an average can hide",
    "what a graph of a function shows", "what a right angle is", "what symmetry is", "what an algorithm is",
    "what a compiler does", "what a database index is", "what encryption protects", "what a firewall blocks",
    "what a router does", "what cloud storage is", "what open-source software is", "what a pixel is",
    "what GPS satellites do", "what a solar panel does", "what a battery stores", "what a heat pump does",
    "what a greenhouse does for plants", "what crop rotation is", "what a hedge does in farmland",
    "what a lichen is", "what a fungus network does in a forest", "what a tadpole becomes",
    "what a caterpillar does in its cocoon", "what plankton is", "what a wetland does", "what a tsunami is",
    "what an avalanche is", "what a drought does to a region", "what a heat wave is",
    "what the Silk Road was", "what the Industrial Revolution changed", "what the Great Wall of China was for",
    "what the printing of maps changed for sailors", "what the Olympic Games were in ancient Greece",
    "what a medieval guild was", "what a castle moat was for", "what the Roman aqueducts did",
    "what the Library of Alexandria held", "what life was like on a sailing ship", "what a pharaoh was",
    "what a samurai was", "what the Vikings traded", "what the gold rush was", "what a lighthouse keeper did",
]
EXPLAIN_TEMPLATES = ["Explain {x}.", "Can you explain {x} in simple terms?", "Explain {x} to a ten-year-old.",
                     "Tell me {x}, in a few paragraphs.", "I have always wondered {x}. Can you tell me?",
                     "Give a short explanation of {x}, with an example."]

GOALS = [  # how-to advice
    "learn to juggle", "start birdwatching", "take better photos with a phone", "learn to draw faces",
    "start a journal and keep it up", "learn to play the ukulele", "tune a guitar by ear", "learn to swim as an adult",
    "start rock climbing", "learn to ice skate", "plan a camping trip", "pitch a tent in the rain",
    "build a campfire safely", "read a topographic map", "start learning sign language", "memorise a speech",
    "prepare for a spelling bee", "organise a book club", "run a neighbourhood clean-up", "plan a surprise party",
    "host a board game night", "teach a dog to sit", "introduce a new cat to a home", "care for a goldfish",
    "keep houseplants alive", "grow herbs on a windowsill", "repot a plant", "paint a room",
    "fix a squeaky door", "unclog a drain without chemicals", "hang a picture straight", "sharpen a kitchen knife",
    "iron a shirt", "sew on a button", "remove a coffee stain", "pack a suitcase efficiently",
    "prepare for a long flight", "get over jet lag", "learn a few words before a trip abroad",
    "choose a first bicycle", "fix a flat bicycle tyre", "wash a car by hand", "save energy at home",
    "reduce food waste", "organise a small kitchen", "declutter a wardrobe", "set up a home office",
    "write a thank-you note", "give a wedding toast", "make small talk at a party", "apologise sincerely",
    "say no politely", "give constructive feedback", "run an efficient meeting", "prioritise a long to-do list",
    "study for an exam in a week", "take good notes in class", "read faster", "learn a poem by heart",
    "start a vegetable patch on a balcony", "make a budget for a holiday", "choose a good watermelon",
    "store fresh bread", "brew tea properly", "make a smoothie without a recipe", "plan meals for a week",
    "teach a child to ride a bike", "keep a toddler busy on a rainy day", "help a teenager with homework",
]
GOAL_TEMPLATES = ["How do I {x}?", "What is the best way to {x}?", "Give me step-by-step advice to {x}.",
                  "I want to {x}. Where should I start?", "What mistakes should I avoid when I try to {x}?"]

STORIES = [  # subjects for stories and poems
    "a beekeeper's daughter who talks to the queen bee", "a cartographer who maps a city that keeps changing",
    "a librarian who finds a book that writes itself", "a tortoise entering a race against a train",
    "a baker whose bread makes people remember their childhood", "a scarecrow that befriends the crows",
    "a violin maker's last violin", "a boy who collects the sounds of his town", "a polar bear on a melting floe",
    "a clock tower that stops at midnight", "a pair of old shoes in a charity shop", "a fox living in a city park",
    "a diver who finds a sunken piano", "a kite flyer on a windless day", "a potter whose bowls never break",
    "a night bus driver and her regular passengers", "a robot vacuum that escapes the house",
    "a tailor who sews a coat for a giant", "a girl who trains a crow to bring her buttons",
    "a hermit crab looking for a new shell", "a chess piece that wants to leave the board",
    "a village festival in the rain", "a bridge that remembers everyone who crossed it",
    "a translator stuck between two arguing kings", "a snowman who wants to see summer",
    "a mapmaker's apprentice on her first voyage", "an elephant who paints", "a lost letter delivered fifty years late",
    "a grandfather's pocket watch", "a tiny island with one tree", "a jellyfish drifting across an ocean",
    "a greenhouse on the Moon", "a stray kitten in a bookstore", "a farmer's market at dawn",
    "a firefly that is afraid of the dark", "a tugboat that pushes a giant ship", "a painter who can only use blue",
]
STORY_TEMPLATES = ["Write a short story about {x}.", "Write a short poem about {x}.", "Write a fable about {x}.",
                   "Write a children's story about {x}.", "Write a story in the first person about {x}."]

DESCRIBE = [  # places, scenes, objects
    "a busy fish market early in the morning", "a quiet monastery in the mountains", "an old railway station",
    "a rainforest canopy", "a coral reef", "a desert oasis", "a salt flat", "a fjord", "a bamboo forest",
    "a medieval market square", "a lighthouse on a stormy night", "a night market in a big city",
    "an abandoned fairground", "a field of sunflowers", "a glacier cave", "an old bookbinder's workshop",
    "a blacksmith's forge", "a busy airport terminal", "a harbour at sunset", "a tiny mountain village in winter",
    "a potter's studio", "a public swimming pool on a hot day", "a school playground at recess",
    "a violin workshop", "a clockmaker's shop", "a flower market", "a steam locomotive",
]
DESCRIBE_TEMPLATES = ["Describe {x}.", "Write a vivid description of {x}.", "Describe the sounds and smells of {x}."]

MESSAGES = [  # everyday situations for letters and messages
    "thank a teacher at the end of the school year", "invite colleagues to a farewell lunch",
    "ask a coworker to swap shifts", "tell a friend I cannot come to their birthday", "welcome a new team member",
    "remind a club about the annual fee", "ask a shop for a refund on a broken kettle",
    "complain to a bus company about a missed connection", "congratulate a cousin on a new baby",
    "ask a neighbourhood group to borrow a ladder", "request a day off from a manager",
    "thank a host after staying at their house", "ask a gym to cancel a membership",
    "announce a change of address to friends", "follow up after a job application",
    "invite grandparents to a school play",
    "ask a doctor's office to move an appointment", "apologise to a friend for forgetting their call",
    "ask a library to extend a loan", "tell a sports team that practice is moved",
]
MESSAGE_TEMPLATES = ["Write a short message to {x}.", "Write a polite email to {x}.",
                     "Help me write a friendly note to {x}."]

PAIRS = [  # comparisons
    ("a crocodile", "an alligator"), ("a frog", "a toad"), ("a rabbit", "a hare"), ("a moth", "a butterfly"),
    ("a violin", "a viola"), ("a piano", "a harpsichord"), ("a lake", "a pond"), ("weather", "climate"),
    ("a hurricane", "a tornado"), ("a virus", "a bacterium"), ("baking soda", "baking powder"),
    ("a latte", "a cappuccino"), ("a crocheted scarf", "a woven scarf"), ("a museum", "a gallery"),
    ("a novel", "a novella"), ("an opera", "a musical"), ("a republic", "a monarchy"), ("a loan", "a grant"),
    ("renting", "buying a home"), ("a city bike", "a mountain bike"), ("a marsh", "a swamp"),
    ("a meteor", "a meteorite"), ("a dolphin", "a porpoise"), ("a cello", "a double bass"),
]
PAIR_TEMPLATES = ["What is the difference between {a} and {b}?", "Compare {a} and {b}.",
                  "How can I tell {a} from {b}?"]

CODE = [  # small code tasks on subjects of their own
    ("Python", "convert a number of seconds into hours, minutes and seconds"),
    ("Python", "check whether two words are anagrams"), ("Python", "roll two dice many times and count the sums"),
    ("Python", "convert a Roman numeral to an integer"), ("Python", "compute the day of the week for a date"),
    ("Python", "validate a simple password with length and digit rules"),
    ("Python", "shuffle a deck of cards and deal five hands"), ("Python", "simulate a simple bank account class"),
    ("JavaScript", "format a number as a currency string"), ("JavaScript", "capitalise the first letter of each word"),
    ("JavaScript", "group an array of objects by a key"), ("JavaScript", "build a simple stopwatch"),
    ("Java", "reverse the words in a sentence"), ("Java", "model a parking lot with classes"),
    ("C", "count the bits set in an integer"), ("C", "read a line of input safely"),
    ("Rust", "compute the average of a vector of floats"), ("Rust", "parse a list of numbers from a string"),
    ("Go", "read a file line by line"), ("Go", "sort a slice of structs by a field"),
    ("Ruby", "count letters in a string with a hash"), ("Kotlin", "filter a list of people by age"),
    ("C#", "compute a running total over a list"), ("Bash", "rename all .txt files in a folder to .md"),
]
CODE_TEMPLATES = ["Write a {lang} program to {t}.", "Show me how to {t} in {lang}, and explain the code.",
                  "In {lang}, how would I {t}?"]


def _fields(subjects: list, *names: str) -> list[dict[str, str]]:
    """Each subject as the template fields it fills (a pair or a (language, task) fills two)."""
    return [dict(zip(names, x if isinstance(x, tuple) else (x,))) for x in subjects]


# category -> (subjects as template fields, templates, prompts drawn per subject); subjects in this order
CATEGORIES = {
    "explain": (_fields(EXPLAIN, "x"), EXPLAIN_TEMPLATES, 2),
    "goals": (_fields(GOALS, "x"), GOAL_TEMPLATES, 2),
    "stories": (_fields(STORIES, "x"), STORY_TEMPLATES, 3),
    "describe": (_fields(DESCRIBE, "x"), DESCRIBE_TEMPLATES, 2),
    "messages": (_fields(MESSAGES, "x"), MESSAGE_TEMPLATES, 2),
    "pairs": (_fields(PAIRS, "a", "b"), PAIR_TEMPLATES, 1),
    "code": (_fields(CODE, "lang", "t"), CODE_TEMPLATES, 2),
}


def touches_held_out(text: str) -> bool:
    """Whether `text` names a held-out subject (broad.EXCLUDED: the benchmark's and calibration prompts' subjects;
    SELECTION_EXCLUDED: the head-selection prompts'): the one rule every generated training prompt is kept by."""
    low = text.lower()
    return any(w in low for w in broad.EXCLUDED) or any(w in low for w in SELECTION_EXCLUDED)


def fresh_prompts(existing: set[str]) -> list[str]:
    """The fresh-subject prompts, shuffled. `existing`: the earlier prompts of train.jsonl; a subject any of them
    contains is dropped, as is any prompt that repeats one or touches an excluded word."""
    rng = random.Random(SEED)
    earlier = " \n ".join(p.lower() for p in existing)
    seen = existing | set(broad.held_out_prompts())
    picked = []
    for fields, templates, per_subject in CATEGORIES.values():
        for subject in fields:
            # a subject is its last field (a pair's second thing, a code task's task)
            if list(subject.values())[-1].lower() in earlier or touches_held_out("|".join(subject.values())):
                continue
            options = [t.format(**subject) for t in templates]
            chosen = [p for p in rng.sample(options, min(per_subject, len(options)))
                      if p not in seen and not touches_held_out(p)]
            seen.update(chosen)
            picked += chosen
    rng.shuffle(picked)
    return picked


def main() -> None:
    prompts = fresh_prompts(broad.earlier_prompts(PREFIX))
    total = broad.write_part(PREFIX, SOURCE, prompts)
    print(f"{HERE / 'train.jsonl'}: {total} prompts ({len(prompts)} fresh)")


if __name__ == "__main__":
    main()
