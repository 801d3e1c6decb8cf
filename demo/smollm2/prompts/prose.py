"""The prose part of the head-training prompts (ids `prose-NNNN` in train.jsonl), written for the project.

Measured on the benchmark's held-out prompts, the EAGLE head trained on the earlier 2840 prompts (40% code) reached
tau 3.25 on code prompts but 2.72 on prose chat prompts (3.20-3.22 on training-held-out prompts of the training
kinds): what it lacks is prose on subjects it has not read. These add only prose, on content lists of their own
(none of broad.py's or wide.py's): stories and poems on new subjects, letters and messages for everyday situations,
descriptions of places, short biographies, historical events, life advice, explanations across ~120 new topics,
opinions with both sides, plans and schedules, recipes, reviews and product copy. Each category gets a quota, drawn
deterministically. broad.py's `EXCLUDED` topics and held-out prompts apply here too, and no prompt repeats one
already in train.jsonl.

    python demo/smollm2/prompts/prose.py          # rewrites the prose-* lines of train.jsonl (idempotent)
"""

from __future__ import annotations

import random
from pathlib import Path

import broad  # the sibling script (its directory is sys.path[0] when run by path; the tests add it)

HERE = Path(__file__).resolve().parent
SEED = 20261203
SOURCE = "spectree project (templated, prose set: demo/smollm2/prompts/prose.py)"
PREFIX = "prose-"


STORY_SUBJECTS = [
    "a lighthouse keeper who finds a message in a bottle", "a retired clockmaker and a stray dog",
    "two rival bakers forced to share a kitchen", "a girl who can hear what houseplants think",
    "a delivery robot that takes a wrong turn", "a beekeeper preparing for a storm",
    "a violinist who loses her instrument on a train", "an old map found inside a library book",
    "a fisherman who catches something that talks", "a town where it rains only on Tuesdays",
    "a child's first day at a new school in a new country", "a mail carrier on her last day before retiring",
    "a museum guard who notices a painting has changed", "a mountain village cut off by an avalanche",
    "a chess match between a grandfather and his granddaughter", "a firefighter rescuing a cat from a rooftop",
    "a detective who solves cases by smell", "a dragon that is afraid of heights",
    "a farmer who grows a pumpkin the size of a car", "a family road trip that goes wrong in a funny way",
    "a shy teenager entering a talent show", "an astronaut's first night back on Earth",
    "a robot learning to paint", "a street musician who plays one song every day",
    "a lost suitcase that travels the world alone", "a knight who would rather be a gardener",
    "two penguins who get separated from their colony", "a ghost who haunts a bookstore",
    "a wedding where everything goes wrong", "a carpenter building a boat in his backyard",
    "an inventor whose machine makes people honest", "a puppy's first snowfall",
    "a pilot who lands on an island not on any map", "a grandmother teaching her grandson to cook",
    "a soccer team that has never won a game", "a cloud that wants to become a river",
    "a night-shift nurse in a small hospital", "a train conductor on the last run of an old line",
    "a squirrel planning a heist on a bird feeder", "a mirror that shows the future",
    "an orphaned elephant and its keeper", "a spaceship crew that wakes up too early",
    "a poet who runs out of words", "a kite that gets stuck in the tallest tree in town",
    "a magician's apprentice on the night of the big show", "a small shop that only sells keys",
]
STORY_TEMPLATES = ["Write a short story about {s}.", "Tell me a bedtime story about {s}.",
                   "Write the opening paragraph of a novel about {s}.", "Write a 200-word story about {s}.",
                   "Write a funny short story about {s}.", "Write a story about {s} with a surprise ending."]

POEM_SUBJECTS = ["the first day of spring", "an empty train station at night", "a grandmother's kitchen",
                 "the sound of rain on a tin roof", "a river in winter", "the last day of summer vacation",
                 "a lighthouse", "an old pair of boots", "the smell of fresh coffee", "a desert at sunrise",
                 "a busy market", "a cat asleep in the sun", "the ocean at dawn", "friendship",
                 "leaving home for the first time", "a thunderstorm", "a forest after a fire", "a harbor at dusk",
                 "a kite on a windy day", "a library", "hope", "a garden at midnight", "the northern wind",
                 "a wedding day", "growing older", "the city waking up", "a letter never sent", "fireflies",
                 "a mountain lake", "the night sky in the countryside"]
POEM_TEMPLATES = ["Write a poem about {s}.", "Write a haiku about {s}.", "Write a short rhyming poem about {s}.",
                  "Write a free-verse poem about {s}.", "Write a limerick about {s}.",
                  "Write a four-line poem about {s}."]

LETTERS = [  # (what the message is for, recipient)
    ("thank a teacher who made a difference", "a former teacher"),
    ("congratulate a friend on a new job", "a friend"), ("apologize for missing a birthday party", "a close friend"),
    ("ask for a deadline extension on a project", "a professor"),
    ("complain about a delayed delivery", "an online store's customer service"),
    ("invite coworkers to a farewell lunch", "my team"), ("request a day off next Friday", "my manager"),
    ("welcome a new member to a book club", "a new member"),
    ("ask a landlord to repair a broken heater", "my landlord"),
    ("decline a job offer politely", "a hiring manager"),
    ("recommend a former colleague for a job", "a hiring manager"),
    ("thank a host after a dinner party", "the hosts"), ("announce a new product launch", "our customers"),
    ("remind a client about an unpaid invoice", "a client"),
    ("ask for a refund for a cancelled concert", "a ticket company"),
    ("introduce myself to new neighbors across the street", "new neighbors"),
    ("say goodbye to colleagues before retiring", "my colleagues"),
    ("ask a local business to sponsor a charity run", "a local business owner"),
    ("follow up after a sales meeting", "a potential customer"),
    ("cancel a gym membership", "the gym's front desk"),
    ("ask a friend to be the best man at my wedding", "my oldest friend"),
    ("report a lost wallet", "the lost-and-found office of a train station"),
    ("thank a nurse who cared for my father", "a hospital nurse"),
    ("ask for feedback after a rejected application", "a recruiter"),
    ("propose a new idea for the office", "my department head"),
    ("invite parents to a school science fair", "parents of students"),
    ("encourage a friend who failed an exam", "a friend"),
    ("notify customers of a price increase", "our subscribers"),
    ("welcome guests to a holiday rental", "guests arriving this weekend"),
    ("request a meeting to discuss a raise", "my manager")]
LETTER_TEMPLATES = ["Write an email to {r} to {w}.", "Help me write a short message to {r} to {w}.",
                    "Draft a {tone} letter to {r} to {w}.", "Write a text message to {r} to {w}."]
TONES = ["friendly", "formal", "warm", "brief and professional", "polite but firm"]

PLACES = ["Lisbon", "Marrakech", "Reykjavik", "Buenos Aires", "Cape Town", "Prague", "Vancouver", "Istanbul",
          "Hanoi", "Edinburgh", "Patagonia", "the Scottish Highlands", "the Swiss Alps", "the Australian outback",
          "the Greek islands", "New Orleans", "Mexico City", "Seoul", "Vienna", "Dubrovnik", "Havana", "Nairobi",
          "Copenhagen", "Lima", "Bali", "the Canadian Rockies", "Tuscany", "Amsterdam", "Santiago", "Cairo",
          "the Faroe Islands", "Quebec City", "Singapore", "the Atacama Desert", "Krakow", "Zanzibar"]
PLACE_TEMPLATES = ["Describe {p} to someone who has never been there.", "What is {p} known for?",
                   "Plan a three-day trip to {p}.", "What should a first-time visitor to {p} see and eat?",
                   "Write a travel blog paragraph about an afternoon in {p}.",
                   "What is the best time of year to visit {p}, and why?"]

PEOPLE = ["Marie Curie", "Leonardo da Vinci", "Nelson Mandela", "Ada Lovelace", "Frida Kahlo", "Isaac Newton",
          "Harriet Tubman", "Wolfgang Amadeus Mozart", "Cleopatra", "Charles Darwin", "Florence Nightingale",
          "Mahatma Gandhi", "Galileo Galilei", "Jane Austen", "Nikola Tesla", "Amelia Earhart", "Confucius",
          "Rosa Parks", "Vincent van Gogh", "Alexander the Great", "Louis Pasteur", "Maya Angelou",
          "Ludwig van Beethoven", "Genghis Khan", "Rachel Carson", "Albert Einstein", "Joan of Arc",
          "Abraham Lincoln", "Wangari Maathai", "Johannes Kepler", "Simón Bolívar", "Katherine Johnson"]
PEOPLE_TEMPLATES = ["Who was {x}?", "Write a short biography of {x}.", "Why is {x} remembered today?",
                    "Tell me three interesting things about {x}.", "What were the main achievements of {x}?",
                    "Explain the life of {x} to a twelve-year-old."]

EVENTS = ["the fall of the Roman Empire", "the French Revolution", "the Renaissance", "the Industrial Revolution",
          "the Apollo 11 moon landing", "the building of the pyramids of Giza", "the Cold War",
          "the discovery of penicillin", "the abolition of slavery in the British Empire",
          "the first transatlantic flight", "the construction of the Eiffel Tower", "the California Gold Rush",
          "the Meiji Restoration", "the Russian Revolution", "the signing of the Declaration of Independence",
          "the invention of the light bulb", "the unification of Germany", "the partition of India",
          "the first Olympic Games of the modern era", "the Spanish flu of 1918", "the Battle of Hastings",
          "the voyage of the Mayflower", "the Cuban Missile Crisis", "the end of apartheid in South Africa",
          "the Hundred Years' War", "the founding of the United Nations", "the Irish potato famine",
          "the invention of the steam engine", "the reign of Queen Victoria", "the fall of Constantinople"]
EVENT_TEMPLATES = ["What happened during {x}?", "Explain the causes and effects of {x}.",
                   "Summarize {x} in a few paragraphs.", "Why was {x} important?",
                   "Describe {x} as a short history lesson.", "What are the main things to know about {x}?"]

SITUATIONS = ["I just moved to a new city and don't know anyone", "my roommate never cleans up",
              "I feel overwhelmed at my new job", "my teenager won't talk to me",
              "I want to get back in touch with an old friend", "I keep procrastinating on a big project",
              "I am nervous about speaking in public", "my partner and I argue about money",
              "I'm thinking about going back to school at forty", "I have too many commitments this month",
              "my dog barks whenever I leave the house", "I want to become a morning person",
              "I'm bored with my daily routine", "my best friend is moving abroad",
              "I got negative feedback from my boss", "I want to read more books this year",
              "I'm caring for an aging parent", "my coworker takes credit for my work",
              "I'm trying to eat less sugar", "I feel lonely working from home",
              "I want to learn to play the piano as an adult", "my child is afraid of the dark",
              "I can't decide between two job offers", "I'm planning my first marathon",
              "I spend too much time on my phone", "I want to grow herbs on a small balcony",
              "I need to tell my friend I can't attend her wedding", "my neighbors are noisy late at night",
              "I'm starting a small online business", "I want to make new friends after college"]
SITUATION_TEMPLATES = ["{s}. What should I do?", "{s}. Any advice?", "Give me some practical tips: {s}.",
                       "{s}. How can I handle this well?", "{s}. Can you help me think it through?"]

EXPLAIN = [  # new topics (none of broad.py's or wide.py's)
    "photosynthesis in desert plants", "how vaccines train the immune system", "plate tectonics",
    "the water cycle", "how rainbows form", "black holes", "how airplanes stay in the air", "ocean currents",
    "why the sky is blue", "how magnets work", "the human heart", "how a refrigerator keeps food cold",
    "how soap removes dirt", "the nitrogen cycle", "how hearing works", "why leaves change color in autumn",
    "how glass is made", "how bridges carry heavy loads", "how a camera lens focuses light",
    "how earthquakes are measured", "what causes wind", "how fish breathe underwater", "how bees make honey",
    "why we dream", "how memory works in the brain", "the placebo effect", "how cheese is made",
    "how paper is recycled", "how a compass works", "how hot air balloons fly", "why ice floats",
    "how electricity reaches our homes", "how coffee is grown and roasted", "how languages change over time",
    "how maps are made", "how credit scores work", "inflation", "supply and demand", "compound interest",
    "how insurance works", "how elections are counted", "the role of a city council",
    "how the stock market works", "how a mortgage works", "minimalism", "stoicism", "the scientific method",
    "critical thinking", "the history of the printing of money", "how the Olympic Games are organized",
    "how a symphony is structured", "why people collect stamps", "how wine is made", "the origins of chess",
    "how tea became popular in Britain", "how hurricanes form", "what causes the seasons", "how coral reefs grow",
    "how birds migrate", "how a seed becomes a tree", "why the ocean is salty", "how a battery stores energy",
    "how a car engine works", "how elevators work", "how noise pollution affects cities",
    "the benefits of walking every day", "how stress affects the body", "how to read a nutrition label",
    "why stretching matters", "what a balanced diet looks like", "how friendships change as we age",
    "why people procrastinate", "how habits of successful students form", "the history of the bicycle",
    "how the postal system works", "how lighthouses guide ships", "why cities have parks",
    "how public libraries started", "the history of chocolate", "how perfume is made",
    "how sign language works", "why some words are hard to translate", "how board games are designed",
    "how animated films are made", "how a newspaper decides what to print", "how museums care for old paintings",
    "the history of the calendar", "how carpets are woven by hand", "why some animals live in groups",
    "how spiders spin webs", "how owls hunt at night", "why cats purr", "how horses were domesticated",
    "the life of a honeybee colony", "how rivers shape valleys", "how caves form", "what makes deserts dry",
    "how windmills were used in the past", "the history of the umbrella", "how trains changed travel",
    "how clocks keep time", "why we have leap seconds", "how recycling plants sort plastic",
]
EXPLAIN_TEMPLATES = ["Explain {x}.", "Explain {x} in simple terms.", "Can you explain {x} with an example?",
                     "Write a short article about {x}.", "I've always wondered about {x}. Can you explain it?",
                     "Explain {x} to a curious teenager.", "Give me a clear, friendly explanation of {x}."]

DEBATES = ["working from home", "school uniforms", "electric cars", "social media for teenagers",
           "a four-day work week", "homework in primary school", "living in a big city", "buying versus renting a home",
           "learning a second language early", "space exploration funding", "online shopping",
           "reading on paper versus on a screen", "video games as a hobby", "self-driving cars",
           "zoos", "single-use plastics bans", "tipping in restaurants", "open-plan offices", "fast fashion",
           "gap years before university", "year-round schooling", "owning a car in a city", "tiny houses",
           "public transport being free", "cash versus card payments"]
DEBATE_TEMPLATES = ["What are the pros and cons of {x}?", "Give me both sides of the debate about {x}.",
                    "Write a short persuasive essay in favor of {x}.", "What are the strongest arguments against {x}?",
                    "Is {x} a good idea? Give a balanced answer."]

PLANS = ["a weekly meal plan for a vegetarian family", "a study schedule for learning Spanish in three months",
         "a beginner's four-week running plan", "a birthday party for a seven-year-old",
         "a weekend camping trip for beginners", "a daily routine for working from home",
         "a small wedding on a tight schedule", "a morning routine that takes thirty minutes",
         "a plan to read twelve books in a year", "a spring cleaning schedule for a house",
         "a team-building day for ten coworkers", "a one-week itinerary for a family beach holiday",
         "a plan to learn photography in a month", "a schedule for a school science fair project",
         "a housewarming party", "a plan to save for a vacation in six months",
         "a week of healthy lunches to take to work", "a reading club's first three meetings",
         "a volunteer clean-up day at a local park", "a bike tour of the countryside over two days"]
PLAN_TEMPLATES = ["Make me {x}.", "Help me plan {x}.", "Can you put together {x}?", "Write out {x}, step by step."]

DISHES = ["a mushroom risotto", "chicken curry", "banana bread", "a Greek salad", "pancakes", "vegetable stir-fry",
          "lemon drizzle cake", "guacamole", "beef stew", "falafel", "shakshuka", "apple pie", "pad thai",
          "a simple omelette", "hummus", "chocolate chip cookies", "roast chicken with vegetables",
          "fish tacos", "a lentil curry", "homemade pizza dough", "french toast", "a fruit smoothie",
          "mashed potatoes", "a spinach quiche", "cinnamon rolls", "fried rice", "a chickpea salad", "carrot cake"]
DISH_TEMPLATES = ["How do I make {x}?", "Give me a simple recipe for {x}.", "What's the secret to really good {x}?",
                  "Write a recipe for {x} that a beginner can follow.", "What can I serve with {x}?"]

REVIEWED = ["a pair of wireless headphones", "a cozy neighborhood café", "a mystery novel", "a hiking backpack",
            "an electric toothbrush", "a family-run Italian restaurant", "a city bike-sharing service",
            "a new animated movie", "a budget-friendly hotel near the airport", "a standing desk",
            "a language-learning app", "a board game for the whole family", "a rain jacket", "a coffee grinder",
            "a yoga class for beginners", "a weekend farmers' market"]
REVIEW_TEMPLATES = ["Write a short customer review of {x}.", "Write a positive online review of {x}.",
                    "Write a balanced review of {x}, mentioning one drawback.",
                    "Write a product description for {x}."]

FORMS = ["a speech for my sister's wedding", "a toast for a retirement party", "a eulogy for a beloved teacher",
         "a welcome speech for the first day of a summer camp", "a short motivational speech for a sports team",
         "an acceptance speech for a community award", "a graduation speech about curiosity",
         "an introduction for a guest speaker at a conference", "a speech thanking volunteers at a charity event",
         "a short talk about the history of our town"]
FORM_TEMPLATES = ["Write {x}.", "Help me write {x}.", "Write {x} that lasts about two minutes."]


def _pools(rng: random.Random) -> dict[str, tuple[int, list[str]]]:
    """Category -> (quota, candidate prompts)."""
    return {
        "stories": (110, [t.format(s=s) for t in STORY_TEMPLATES for s in STORY_SUBJECTS]),
        "poems": (60, [t.format(s=s) for t in POEM_TEMPLATES for s in POEM_SUBJECTS]),
        "letters": (80, [t.format(r=r, w=w, tone=rng.choice(TONES)) for t in LETTER_TEMPLATES for w, r in LETTERS]),
        "places": (80, [t.format(p=p) for t in PLACE_TEMPLATES for p in PLACES]),
        "people": (70, [t.format(x=x) for t in PEOPLE_TEMPLATES for x in PEOPLE]),
        "events": (70, [t.format(x=x) for t in EVENT_TEMPLATES for x in EVENTS]),
        "advice": (80, [t.format(s=s[0].upper() + s[1:] if t.startswith("{s}") else s) for t in SITUATION_TEMPLATES
                        for s in SITUATIONS]),
        "explanations": (170, [t.format(x=x) for t in EXPLAIN_TEMPLATES for x in EXPLAIN]),
        "debates": (50, [t.format(x=x) for t in DEBATE_TEMPLATES for x in DEBATES]),
        "plans": (40, [t.format(x=x) for t in PLAN_TEMPLATES for x in PLANS]),
        "recipes": (55, [t.format(x=x) for t in DISH_TEMPLATES for x in DISHES]),
        "reviews": (35, [t.format(x=x) for t in REVIEW_TEMPLATES for x in REVIEWED]),
        "speeches": (20, [t.format(x=x) for t in FORM_TEMPLATES for x in FORMS]),
    }


def prose_prompts(existing: set[str]) -> list[str]:
    """The prose prompts, shuffled. `existing`: prompts already in train.jsonl (none of them repeats)."""
    rng = random.Random(SEED)
    picked, seen = [], existing | set(broad.held_out_prompts())
    for _name, (quota, candidates) in _pools(rng).items():
        pool = [p for p in dict.fromkeys(candidates)
                if p not in seen and not any(w in p.lower() for w in broad.EXCLUDED)]
        chosen = rng.sample(pool, min(quota, len(pool)))
        seen.update(chosen)
        picked += chosen
    rng.shuffle(picked)
    return picked


def main() -> None:
    prompts = prose_prompts(broad.earlier_prompts(PREFIX))
    total = broad.write_part(PREFIX, SOURCE, prompts)
    print(f"{HERE / 'train.jsonl'}: {total} prompts ({len(prompts)} prose)")


if __name__ == "__main__":
    main()
