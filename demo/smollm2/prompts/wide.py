"""The wide part of the head-training prompts (ids `wide-NNNN` in train.jsonl), written for the project.

A head trained on the answers to the first 1614 training prompts (train-* and broad-*) agreed with the target 0.76
of the time on its training text but only 0.64 on held-out prompts: it is data-limited, and more of the same
templates would not help. These add breadth instead, with content lists of their own (none of broad.py's): explanations
across science, health, geography, history, economics, law, art, music, sports, nature and everyday technology;
practical how-to advice; factual questions; word problems with seeded numbers; writing tasks that include the text to
summarize, rewrite or classify; translations; role prompts; and code beyond broad's tasks (new algorithms in 14
languages, debugging and explaining a given snippet, SQL over a described table, shell, regular expressions, unit
tests for a given function, refactoring, HTTP/JSON). Each category gets a quota (code about 40%), drawn
deterministically. broad.py's `EXCLUDED` topics and held-out prompts apply here too, and no prompt repeats one
already in train.jsonl.

    python demo/smollm2/prompts/wide.py           # rewrites the wide-* lines of train.jsonl (idempotent)
"""

from __future__ import annotations

import random
from pathlib import Path
from textwrap import dedent

import broad  # the sibling script (its directory is sys.path[0] when run by path; the tests add it)

HERE = Path(__file__).resolve().parent
SEED = 20261215
SOURCE = "spectree project (templated, wide set: demo/smollm2/prompts/wide.py)"


def _code(tag: str, text: str) -> str:
    return f"```{tag}\n{dedent(text).strip()}\n```"


# ---------------------------------------------------------------------------------------------------------- code
LANGS = ["Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C#", "C++", "Ruby", "Kotlin", "Swift", "PHP",
         "Scala", "Dart"]
ALGOS = ["compute the running total of a list of numbers", "find all pairs in an array that add up to a target sum",
         "convert a string from snake_case to camelCase", "check whether a year is a leap year",
         "compute the Levenshtein distance between two strings", "find the longest word in a sentence",
         "remove all whitespace from a string", "compute a moving average with a window of size k",
         "find the missing number in a list that should contain 1 to n", "interleave the elements of two lists",
         "compute the dot product of two vectors", "convert a hex color code such as #FF8800 to RGB values",
         "implement insertion sort", "implement quicksort", "implement a min-heap with push and pop",
         "find the kth smallest element in an array", "check whether a string contains only digits",
         "truncate a string to n characters and add an ellipsis", "pad a number with leading zeros",
         "count the number of days between two dates", "shuffle an array with the Fisher-Yates algorithm",
         "generate all permutations of a short string", "generate all subsets of a small set",
         "find the majority element in an array", "convert a number of seconds into hours, minutes and seconds",
         "implement a trie with insert and search", "detect a cycle in a linked list",
         "find the intersection of two arrays", "compute the sum of the digits of an integer",
         "convert a sentence to pig latin", "validate a credit card number with the Luhn algorithm",
         "find the length of the longest increasing subsequence", "implement Dijkstra's shortest path algorithm",
         "scale a list of numbers to the range 0 to 1", "wrap text to a maximum line width",
         "parse a URL query string into key-value pairs", "turn an article title into a URL slug",
         "compute the greatest common divisor of two numbers", "find the first non-repeating character in a string",
         "implement a fixed-size circular buffer"]
ALGO_TEMPLATES = ["Can you write {lang} code that will {t}?", "In {lang}, what's the cleanest way to {t}?",
                  "Write a {lang} function to {t}, and state its time complexity.",
                  "I'm learning {lang}. How would I {t}?", "Give me a {lang} snippet that shows how to {t}.",
                  "Using only the {lang} standard library, {t}.",
                  "Explain step by step how to {t} in {lang}, then show the code.",
                  "What's an efficient way to {t} in {lang} when the input is very large?"]

DEBUG = [  # (language, fence tag, intended behaviour, symptom, code)
    ("Python", "python", "return the average of a list", "always returns a number that is one too small", """
        def average(nums):
            total = 0
            for n in nums:
                total += n
            return total / len(nums) - 1
     """),
    ("Python", "python", "start with a fresh list on every call", "keeps items from earlier calls", """
        def add_item(item, items=[]):
            items.append(item)
            return items
     """),
    ("JavaScript", "javascript", "print 0, 1 and 2", "prints 3 three times", """
        for (var i = 0; i < 3; i++) {
          setTimeout(() => console.log(i), 100);
        }
     """),
    ("JavaScript", "javascript", "return true only for the number zero", "returns true for an empty string", """
        function isZero(x) {
          return x == 0;
        }
        console.log(isZero(""));
     """),
    ("Java", "java", "print \"match\"", "never prints anything", """
        String a = new String("hi");
        if (a == "hi") {
            System.out.println("match");
        }
     """),
    ("C", "c", "return a greeting string", "sometimes gives the caller garbage characters", """
        char *greet(void) {
            char buf[32];
            strcpy(buf, "hello");
            return buf;
        }
     """),
    ("Go", "go", "add up the numbers in a slice", "returns 3 for []int{5, 5, 5}", """
        func sum(nums []int) int {
            var total int
            for i := range nums {
                total += i
            }
            return total
        }
     """),
    ("Python", "python", "print the user's age next year", "crashes with a TypeError", """
        age = input("Age: ")
        print("Next year you will be " + age + 1)
     """),
    ("Python", "python", "remove every 2 from the list", "leaves one 2 in the list", """
        nums = [1, 2, 2, 3]
        for n in nums:
            if n == 2:
                nums.remove(n)
        print(nums)
     """),
    ("Rust", "rust", "print the string", "does not compile", """
        let s = String::from("hi");
        let t = s;
        println!("{}", s);
     """),
    ("JavaScript", "javascript", "return the parsed items from the API", "throws \"json is not a function\"", """
        async function load() {
          const data = fetch("/api/items").json();
          return data;
        }
     """),
    ("SQL", "sql", "count the employees in each department", "fails with an error about GROUP BY", """
        SELECT department, COUNT(*) FROM employees;
     """),
    ("Python", "python", "print \"equal\"", "never prints anything", """
        if 0.1 + 0.2 == 0.3:
            print("equal")
     """),
    ("C++", "cpp", "return the average of two ints", "returns a negative number for very large inputs", """
        int average(int a, int b) {
            return (a + b) / 2;
        }
     """),
    ("Python", "python", "increase a global counter", "raises an UnboundLocalError", """
        count = 0

        def increment():
            count += 1

        increment()
     """),
    ("Java", "java", "read Sam's age or fall back gracefully", "throws a NullPointerException", """
        Map<String, Integer> ages = new HashMap<>();
        int age = ages.get("Sam");
     """),
    ("Bash", "bash", "delete one file", "tries to delete two files that don't exist", """
        name="my file.txt"
        rm $name
     """),
    ("Python", "python", "keep a separate member list per team", "makes every team share the same members", """
        class Team:
            members = []

            def add(self, name):
                self.members.append(name)
     """),
    ("JavaScript", "javascript", "increase count to 1", "leaves count at 0", """
        const counter = {
          count: 0,
          inc: () => { this.count++; }
        };
        counter.inc();
     """),
    ("Go", "go", "fetch every URL before printing done", "exits before any fetch finishes", """
        for _, url := range urls {
            go fetch(url)
        }
        fmt.Println("done")
     """),
]
DEBUG_TEMPLATES = ["This {lang} code should {intent}, but it {symptom}. What is the bug and how do I fix it?\n\n{code}",
                   "My {lang} code {symptom}. What's wrong?\n\n{code}",
                   "Debug this {lang} snippet for me. Expected: it should {intent}. Actual: it {symptom}.\n\n{code}",
                   "{code}\n\nThis {lang} code {symptom}. Why does that happen, and how should I change it?"]

SNIPPETS = [  # (language, fence tag, code) to explain
    ("Python", "python", "print(sorted(words, key=len, reverse=True)[:3])"),
    ("Python", "python", "pairs = list(zip(names, scores))\nbest = max(pairs, key=lambda p: p[1])"),
    ("Python", "python", "if any(x < 0 for x in values):\n    raise ValueError(\"negative value\")"),
    ("Python", "python", "a, b = b, a"),
    ("Python", "python", "if __name__ == \"__main__\":\n    main()"),
    ("JavaScript", "javascript", "const total = cart.reduce((sum, item) => sum + item.price * item.qty, 0);"),
    ("JavaScript", "javascript", "const unique = [...new Set(tags)];"),
    ("JavaScript", "javascript", "const { name, ...rest } = user;"),
    ("JavaScript", "javascript", "document.querySelectorAll(\"button\").forEach(b =>\n"
                                 "  b.addEventListener(\"click\", () => b.classList.toggle(\"active\")));"),
    ("Bash", "bash", "find . -name \"*.log\" -mtime +7 -delete"),
    ("Bash", "bash", "ps aux | grep python | awk '{print $2}'"),
    ("Bash", "bash", "tar -czf backup.tar.gz ~/projects"),
    ("SQL", "sql", "SELECT department, AVG(salary)\nFROM staff\nGROUP BY department\nHAVING AVG(salary) > 50000;"),
    ("Go", "go", "ch := make(chan int)\ngo func() { ch <- 42 }()\nfmt.Println(<-ch)"),
    ("Rust", "rust", "let evens: Vec<i32> = (1..=10).filter(|n| n % 2 == 0).collect();"),
    ("C", "c", "x = x & (x - 1);"),
    ("Java", "java", "List<String> result = names.stream()\n    .filter(s -> s.startsWith(\"A\"))\n"
                     "    .map(String::toUpperCase)\n    .collect(Collectors.toList());"),
    ("Ruby", "ruby", "words.group_by(&:length).transform_values(&:count)"),
    ("Kotlin", "kotlin", "val name = user?.name ?: \"guest\""),
    ("C#", "csharp", "var adults = people.Where(p => p.Age >= 18).OrderBy(p => p.Name).ToList();"),
    ("shell", "bash", "git log --oneline --graph --all"),
]
SNIPPET_TEMPLATES = ["What does this {lang} code do?\n\n{code}", "Explain this {lang} snippet line by line:\n\n{code}",
                     "I found this {lang} code in a project. What does it do, and is there anything risky about it?"
                     "\n\n{code}"]

TABLES = {  # table description -> questions
    "employees(id, name, department, salary, hire_date)": [
        "the average salary in each department", "everyone hired in 2023",
        "the highest-paid employee in each department",
        "departments with more than ten employees", "the second highest salary"],
    "books(id, title, author, year, price)": [
        "all books by authors whose name starts with M", "the number of books published in each decade",
        "the cheapest book by each author", "books that have no price set"],
    "flights(id, origin, destination, departure_time, seats_sold, capacity)": [
        "flights that are more than 90 percent full", "the route with the most flights",
        "the number of departures from each airport per day"],
    "movies(id, title, genre, release_year, rating)": [
        "the three best-rated movies in each genre", "the average rating per release year",
        "genres where no movie is rated above 8"],
    "page_views(user_id, url, viewed_at)": [
        "the number of unique visitors per day", "users who viewed the same page more than five times",
        "the most viewed page in the last seven days"],
    "products(id, name, category, stock, price)": [
        "products that are out of stock", "the total stock value per category", "the five most expensive products"],
}
SQL_TEMPLATES = ["Given a table {table}, write SQL to find {q}.",
                 "I have a table {table}. How do I get {q} in PostgreSQL?",
                 "Write a SQL statement for a table {table} that returns {q}, and explain each clause."]

SHELL = ["find the ten largest files in a directory", "count the lines in every .py file in a project",
         "rename all .jpeg files in a folder to .jpg", "see which process is using port 8080",
         "replace a word in every text file in a directory", "show how much disk space each folder uses",
         "download a file from a URL", "run a script every five minutes", "compress a folder into a zip archive",
         "copy a folder to a remote server", "search for a string in all files under a folder",
         "show the last 50 lines of a log file and keep following it", "make a script executable",
         "check how much free memory the machine has", "delete all empty directories",
         "sort a text file and remove duplicate lines", "add a directory to my PATH permanently",
         "stop a program that is not responding", "list the files modified in the last day",
         "print the second column of a tab-separated file", "create an SSH key and copy it to a server"]
SHELL_TEMPLATES = ["How do I {t} from the Linux command line?", "What's the shell command to {t}?",
                   "Write a Bash one-liner to {t}.", "On macOS, how can I {t} in the terminal?",
                   "How do I {t} in PowerShell on Windows?"]
SCRIPTING = ["loop over the lines of a file", "check whether a file exists", "read command-line arguments",
             "stop on the first error", "ask the user a yes-or-no question", "log messages with a timestamp"]
SCRIPTING_TEMPLATES = ["How do I {t} in a Bash script?", "Write a short shell script that shows how to {t}."]

REGEXES = ["matches a US ZIP code, with or without the four-digit extension",
           "matches a hex color like #1a2b3c or #fff",
           "extracts all hashtags from a social media post", "matches a time in 24-hour format like 23:59",
           "accepts usernames of 3 to 16 letters, digits or underscores", "finds repeated words such as \"the the\"",
           "matches a UK postcode", "captures the domain name from a URL",
           "matches a version number like 1.4.2", "matches a phone number written like (555) 123-4567",
           "removes HTML tags from a string", "matches a decimal number with an optional sign",
           "finds every word that starts with a capital letter", "matches a MAC address",
           "splits a line on commas that are not inside double quotes"]
REGEX_TEMPLATES = ["Write a regular expression that {r}.", "Give me a regex that {r}, and explain each part.",
                   "What regex {r}? Include examples that should and should not match."]
REGEX_LANG_TEMPLATE = "How would I use a regex in {lang} that {r}?"
REGEX_LANGS = ["Python", "JavaScript", "Java", "Go"]

TESTED = [  # (language, fence tag, frameworks, code) to write unit tests for
    ("Python", "python", ["unittest"], """
        def slugify(title):
            return "-".join(title.lower().split())
     """),
    ("Python", "python", ["unittest"], """
        def clamp(x, low, high):
            return max(low, min(x, high))
     """),
    ("Python", "python", ["unittest"], """
        def is_leap(year):
            return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
     """),
    ("Python", "python", ["unittest"], """
        def word_count(text):
            return len(text.split())
     """),
    ("JavaScript", "javascript", ["Jest", "Mocha"], """
        function capitalize(s) {
          return s.charAt(0).toUpperCase() + s.slice(1);
        }
     """),
    ("JavaScript", "javascript", ["Jest", "Mocha"], """
        function sumBy(items, key) {
          return items.reduce((t, x) => t + x[key], 0);
        }
     """),
    ("Java", "java", ["JUnit 5"], """
        public static int maxOf(int[] xs) {
            int best = xs[0];
            for (int x : xs) if (x > best) best = x;
            return best;
        }
     """),
    ("Go", "go", ["the testing package"], """
        func Reverse(s string) string {
            r := []rune(s)
            for i, j := 0, len(r)-1; i < j; i, j = i+1, j-1 {
                r[i], r[j] = r[j], r[i]
            }
            return string(r)
        }
     """),
    ("Rust", "rust", ["a #[cfg(test)] module"], """
        fn initials(name: &str) -> String {
            name.split_whitespace().filter_map(|w| w.chars().next()).collect()
        }
     """),
    ("C#", "csharp", ["xUnit", "NUnit"], """
        public static bool IsStrongPassword(string p) =>
            p.Length >= 12 && p.Any(char.IsDigit) && p.Any(char.IsUpper);
     """),
]
TEST_TEMPLATES = ["Write unit tests using {fw} for this {lang} function, including edge cases:\n\n{code}",
                  "Here is a small {lang} function:\n\n{code}\n\nWhat test cases should it have? Write them with {fw}.",
                  "How would I test this {lang} function with {fw}?\n\n{code}"]

REFACTOR = [  # (language, fence tag, code)
    ("Python", "python", """
        def grade(score):
            if score >= 90:
                return "A"
            else:
                if score >= 80:
                    return "B"
                else:
                    if score >= 70:
                        return "C"
                    else:
                        return "F"
     """),
    ("JavaScript", "javascript", """
        getUser(id, function (user) {
          getOrders(user, function (orders) {
            render(orders);
          });
        });
     """),
    ("Java", "java", """
        if (status.equals("active")) { return 1; }
        else if (status.equals("paused")) { return 2; }
        else if (status.equals("closed")) { return 3; }
        else { return 0; }
     """),
    ("Python", "python", """
        total = 0

        def add_to_total(x):
            global total
            total = total + x
     """),
    ("JavaScript", "javascript", """
        var msg = "Hello, " + user.first + " " + user.last + "! You have " + n + " new messages.";
     """),
    ("Python", "python", """
        def price_with_tax(p):
            return p * 1.2 + 4.99
     """),
    ("C#", "csharp", """
        public double Area(string shape, double a, double b) {
            if (shape == "rect") return a * b;
            if (shape == "tri") return 0.5 * a * b;
            return 0;
        }
     """),
    ("Go", "go", """
        data, err := os.ReadFile(path)
        if err != nil {
            fmt.Println(err)
            os.Exit(1)
        }
        var cfg Config
        err = json.Unmarshal(data, &cfg)
        if err != nil {
            fmt.Println(err)
            os.Exit(1)
        }
     """),
]
REFACTOR_TEMPLATES = ["Refactor this {lang} code to make it more readable:\n\n{code}",
                      "How can I clean up this {lang} snippet? Explain what you changed.\n\n{code}",
                      "Can you rewrite this {lang} code in a more natural style for the language?\n\n{code}"]

API_TASKS = ["send a POST request with a JSON body", "parse a JSON string and read a nested field",
             "call a REST API and handle a timeout", "add a bearer token to the Authorization header of a request",
             "pretty-print a JSON object", "build a minimal web server with one endpoint that returns JSON",
             "download a web page and extract its title", "page through an API that returns a link to the next page",
             "check that a JSON payload has all the required fields", "upload a file with a multipart form request",
             "write a list of objects to a file as JSON", "read settings from a JSON file with default values",
             "handle a 429 Too Many Requests response from an API", "process a very large JSON file as a stream",
             "serialize a date field as an ISO 8601 string in JSON"]
API_LANGS = ["Python", "JavaScript (Node.js)", "Go", "Java", "C#", "Ruby", "PHP", "Rust"]
API_TEMPLATES = ["Show me {lang} code to {t}.", "What is the simplest way to {t} using {lang}?",
                 "Write a {lang} example that shows how to {t}, with error handling."]

DEV_CONCEPTS = ["memory leaks", "race conditions", "deadlocks", "the JavaScript event loop", "lazy evaluation",
                "pure functions", "higher-order functions", "generics", "interfaces in Go", "ownership in Rust",
                "SQL injection", "cross-site scripting", "password hashing", "OAuth", "WebSockets", "message queues",
                "load balancers", "microservices", "serverless functions", "floating-point rounding errors",
                "UTF-8 and character encodings", "bitwise operators", "the singleton pattern", "the observer pattern",
                "technical debt", "feature flags", "linters", "static typing", "mutexes", "CORS", "DNS",
                "API rate limiting", "database transactions", "database normalization", "byte order (endianness)",
                "shallow and deep copies", "idempotent API requests", "log levels", "the CAP theorem", "webhooks"]
DEV_TEMPLATES = ["Can you explain {c} with a concrete example?", "What should a junior developer know about {c}?",
                 "Give me a quick explanation of {c}, then a small code example.",
                 "Summarize {c} in three bullet points.",
                 "How would you explain {c} to someone who has never programmed?"]

# ------------------------------------------------------------------------------------------------------ non-code
TOPICS = [  # explanations across domains (number-agnostic noun phrases)
    # science
    "the theory of evolution", "the periodic table", "chemical bonds", "entropy", "electric circuits",
    "the speed of light", "static electricity", "sound waves", "the greenhouse effect", "the immune system",
    "cell division", "enzymes", "acids and bases", "friction", "the states of matter", "the carbon cycle",
    # health
    "high blood pressure", "type 2 diabetes", "dehydration", "seasonal allergies", "vitamin D", "cholesterol",
    "anxiety", "concussions", "good posture at a desk", "food poisoning", "sunburn and sunscreen", "gut bacteria",
    # geography
    "the Amazon rainforest", "the Sahara desert", "the Himalayas", "the Nile", "monsoons", "the Great Barrier Reef",
    "time zones", "the equator", "Norway's fjords", "river deltas", "glaciers", "the Panama Canal",
    # history
    "the Silk Road", "the Black Death", "the Ottoman Empire", "the American Civil War", "the Magna Carta",
    "the Aztec Empire", "the Viking Age", "the Great Depression", "the Berlin Wall", "the ancient Olympic Games",
    "the Ming dynasty", "the Age of Exploration", "women's suffrage", "the Roman Republic",
    # economics
    "interest rates", "tariffs", "GDP", "unemployment", "the gig economy", "index funds", "central banks",
    "exchange rates", "monopolies", "income tax", "economies of scale", "diminishing returns", "trade deficits",
    # law
    "copyright", "trademarks", "patents", "the presumption of innocence", "small claims court", "tenant rights",
    "contracts", "wills", "jury duty", "fair use", "the GDPR", "power of attorney",
    # art
    "Impressionism", "the Baroque period", "Cubism", "perspective in drawing", "color theory", "street art",
    "watercolor painting", "ancient Greek sculpture", "Japanese woodblock prints", "Art Nouveau", "Surrealism",
    # music
    "musical scales", "jazz improvisation", "the sections of an orchestra", "the blues", "the origins of hip-hop",
    "rhythm and tempo", "chords", "opera", "sheet music", "the electric guitar", "K-pop", "folk music",
    # sports
    "the offside rule in soccer", "cricket scoring", "the Tour de France", "tennis scoring", "sports nutrition",
    "yoga", "bouldering", "chess openings", "the rules of rugby", "the shot clock in basketball",
    # nature and animals
    "octopus intelligence", "animal camouflage", "birdsong", "coral bleaching", "hibernation", "whale migration",
    "ant colonies", "bioluminescence", "endangered species", "pollination", "mushrooms and other fungi",
    "wolf packs", "the life cycle of a butterfly",
    # space
    "the life cycle of the Sun", "comets", "asteroids", "the Milky Way", "the International Space Station",
    "galaxies", "the Big Bang", "solar eclipses", "light-years", "the northern lights", "dark matter",
    "neutron stars", "meteor showers",
    # everyday technology
    "Wi-Fi", "Bluetooth", "two-factor authentication", "cloud storage", "QR codes", "password managers",
    "video streaming", "smart speakers", "VPNs", "USB-C", "lithium-ion batteries", "e-ink screens",
    "browser cookies", "spam filters", "5G networks"]
FORMATS = ["in three bullet points", "in one paragraph", "for a ten-year-old", "in under 100 words",
           "with one real-world example", "as if I were a complete beginner"]
TOPIC_TEMPLATES = ["Explain {x} {fmt}.", "Can you give me an overview of {x}?",
                   "What are the key things to know about {x}?", "Tell me about {x} {fmt}.",
                   "Write a short explainer about {x} for a school newsletter.",
                   "What do most people get wrong about {x}?", "Give me three surprising facts about {x}.",
                   "How would you teach {x} in a fifteen-minute lesson?"]

QUESTIONS = ["Why do we get brain freeze when eating ice cream?", "Why do some people need glasses?",
             "How do antibiotics work, and why don't they help against viruses?",
             "How do doctors measure blood pressure?", "Why do muscles feel sore a day or two after exercise?",
             "How does caffeine affect the body?", "Why do cats usually land on their feet?",
             "How do bats find their way in the dark?", "Why do some birds fly in a V formation?",
             "How do chameleons change color?", "Why is the Dead Sea so salty?", "How did the Grand Canyon form?",
             "Why is Venice built on water?", "Why did the Roman Empire split into east and west?",
             "How did ancient sailors navigate without modern instruments?", "Why was the Great Wall of China built?",
             "What led to the start of World War I?", "Why do gas prices change so often?",
             "How do banks make money?", "Why do some European countries use the euro and others do not?",
             "What rights do I have if a product I bought online is faulty?",
             "How does a bill become a law in the United States?",
             "Why did Van Gogh sell so few paintings during his lifetime?",
             "Why do minor keys sound sad to many listeners?", "How does a piano produce sound?",
             "Why do orchestras tune to the oboe?", "Why is a marathon 42.195 kilometers long?",
             "Why do golf balls have dimples?", "How does a curveball curve?",
             "Why do astronauts float on the International Space Station?",
             "How do astronomers know how far away stars are?", "How does a comet get its tail?",
             "Why does my phone get warm while charging?", "Why does Wi-Fi get slower when more people use it?",
             "How do wireless chargers work?", "Why do pine trees stay green all winter?",
             "How do plant roots know which way to grow?", "Why do some people get motion sickness in cars?",
             "Why do we yawn?", "How does the body control its temperature?", "How do hurricanes get their names?",
             "Why does salt melt ice on roads?", "How do fireflies glow?", "Why do we have fingerprints?",
             "How do submarines dive and surface?", "Why do our ears pop on airplanes?",
             "How do noise-cancelling earbuds know what sound to cancel?", "Why do prices end in .99 so often?"]
QUESTION_SUFFIXES = ["", " Keep it short.", " Please answer {fmt}."]

FACTS = ["What is the capital of Australia?", "How many bones are in the adult human body?",
         "Who wrote Pride and Prejudice?", "What is the largest ocean on Earth?",
         "How long does sunlight take to reach Earth?", "What language is spoken in Brazil?",
         "Who painted The Starry Night?", "What is the tallest mountain in Africa?", "When did the Berlin Wall fall?",
         "What gas do plants take in from the air?", "What is the chemical symbol for gold?",
         "How many players does a soccer team have on the field?", "What is the longest river in South America?",
         "What is the smallest country in the world?", "How many hearts does an octopus have?",
         "What currency is used in Switzerland?", "Which organ produces insulin?", "In what year did the Titanic sink?",
         "Who composed The Four Seasons?", "How many continents are there?", "What does DNA stand for?",
         "What does CPU stand for?", "How long is a marathon?",
         "Who were the first people to reach the top of Mount Everest?",
         "What is the largest hot desert in the world?", "How fast does sound travel in air?",
         "Who discovered penicillin?", "What is the capital of Canada?", "What is the largest mammal?",
         "How many strings does a standard guitar have?", "Which blood type is the universal donor?",
         "What does a barometer measure?", "Who wrote One Hundred Years of Solitude?",
         "How many sides does a hexagon have?", "What are the three primary colors in painting?",
         "What is the largest organ of the human body?", "What is the capital of Kenya?",
         "Which instrument has 88 keys?", "Who was the first woman to win a Nobel Prize?",
         "What is the official language of Egypt?", "How many time zones does Russia have?",
         "What is the hardest natural material?", "Which country gifted the Statue of Liberty to the United States?",
         "What is the most spoken language in the world?", "How many chambers does the human heart have?",
         "What is the capital of New Zealand?", "Who wrote the play Romeo and Juliet?",
         "What is the freezing point of water in Kelvin?", "How many players are on a basketball team on court?",
         "What is the largest country in South America?"]
FACT_TEMPLATES = ["{q}", "Quick question: {q}", "{q} Please answer in one sentence."]

HOWTO = ["unclog a kitchen sink", "get rid of mold in the bathroom", "fix a squeaky door",
         "paint a room without a mess",
         "lower my heating bill in winter", "remove a red wine stain from a carpet", "hang a heavy mirror on drywall",
         "declutter a small apartment", "clean a cast-iron pan", "keep fruit flies out of the kitchen",
         "pack a carry-on for a week-long trip", "deal with jet lag", "find cheap flights",
         "plan a road trip across several states", "stay safe when traveling alone",
         "avoid getting sick on a long flight", "learn basic phrases before visiting another country",
         "choose travel insurance", "sharpen a kitchen knife", "cook rice so it isn't sticky", "sear a steak",
         "make a roux", "poach an egg", "season food without much salt", "keep fresh herbs from wilting",
         "caramelize onions", "prepare meals for a busy week on Sunday", "do a proper push-up",
         "start strength training at home", "improve my flexibility", "train for a 5K", "warm up before exercise",
         "build a workout routine with no equipment", "avoid injuries when lifting weights",
         "build an emergency fund", "pay off credit card debt", "start investing with a small amount of money",
         "read my credit report", "decide whether to save or pay off a loan first",
         "split shared expenses with roommates", "file my taxes for the first time", "take better notes in lectures",
         "memorize formulas for an exam", "study with flashcards effectively", "write a strong thesis statement",
         "prepare for a math exam in two weeks", "read a scientific paper", "ask my manager for feedback",
         "switch careers into tech", "write a professional bio", "handle a difficult coworker",
         "prepare for a performance review", "network at a conference", "set boundaries at work",
         "write a resignation letter", "start freelancing", "give constructive criticism kindly",
         "run an effective team meeting", "choose a laptop for university", "back up the photos on my phone"]
HOWTO_TEMPLATES = ["What's the best way to {g}?", "Walk me through how to {g}, step by step.",
                   "I want to {g}. Where do I start?", "Give me a short checklist to {g}.",
                   "What mistakes should I avoid when I try to {g}?", "Explain how to {g} {fmt}."]

CONTRASTS = [("a virus", "a bacterium"), ("weather", "climate"), ("a crocodile", "an alligator"),
             ("baking soda", "baking powder"), ("stocks", "bonds"), ("a debit card", "a credit card"),
             ("an LLC", "a sole proprietorship"), ("affect", "effect"), ("empathy", "sympathy"),
             ("a hurricane", "a tornado"), ("a frog", "a toad"), ("a violin", "a viola"), ("latitude", "longitude"),
             ("mitosis", "meiosis"), ("an asteroid", "a comet"), ("speed", "velocity"), ("a will", "a trust"),
             ("cardio", "strength training"), ("HDMI", "DisplayPort"), ("OLED", "LCD screens"),
             ("a cold", "seasonal allergies"), ("a museum", "a gallery"), ("a simile", "a metaphor in poetry"),
             ("a republic", "a monarchy")]
CONTRAST_TEMPLATES = ["What's the difference between {a} and {b}?", "How can I tell {a} from {b}?",
                      "Compare {a} and {b} as a short table."]

EMAILS = [("my landlord", "asking for a leaking faucet to be repaired"),
          ("a customer", "apologizing for a delayed shipment"), ("my team", "announcing that I am leaving the company"),
          ("a hotel", "asking whether early check-in is possible"),
          ("a colleague", "asking for help with a spreadsheet"),
          ("my child's teacher", "asking for details about an upcoming field trip"),
          ("a client", "following up on an unpaid invoice"), ("a recruiter", "politely declining a job offer"),
          ("my gym", "cancelling my membership"), ("a conference organizer", "proposing a talk"),
          ("a coworker", "thanking them for covering my shift"), ("my manager", "requesting two days off next month"),
          ("a supplier", "asking for a discount on a large order"),
          ("a friend", "inviting them to a board game night"), ("a new hire", "welcoming them to the team"),
          ("a plumber", "asking for a quote to replace a water heater")]
EMAIL_TONES = ["short", "polite", "friendly", "formal", "firm but polite"]
EMAIL_TEMPLATES = ["Write a {tone} email to {r} {s}.", "Draft an email to {r} {s}. Keep it under 120 words.",
                   "Help me write a message to {r} {s}."]

PARAGRAPHS = [
    "Beekeeping has become popular in many cities over the past decade. Rooftop hives on offices and apartment "
    "buildings produce surprising amounts of honey, because urban gardens and parks offer a wide variety of flowers "
    "throughout the season. However, some researchers warn that too many hives in one area can leave wild bees with "
    "less food, and they recommend planting more flowers rather than simply adding more hives.",
    "When the company moved to a hybrid schedule, employees were asked to come to the office on Tuesdays and "
    "Thursdays. Attendance was high at first but dropped after three months. A survey found that most people valued "
    "the office for meetings and collaboration, but preferred to do focused work at home. Managers are now "
    "considering making office days optional and reserving them for team planning sessions.",
    "The town library reopened last month after an eighteen-month renovation. The new building has a larger "
    "children's section, a quiet study floor, and a small workshop with 3D printers and sewing machines that anyone "
    "with a library card can book. Visitor numbers in the first four weeks were twice as high as before the "
    "renovation, and the library plans to extend its opening hours on weekends.",
    "Microplastics are tiny fragments of plastic less than five millimeters long. They come from larger items that "
    "break down over time, as well as from synthetic clothing fibers and some cosmetics. Scientists have found them "
    "in oceans, rivers, soil, and even in the air. Researchers are still studying how they affect human health, but "
    "many countries have already banned microbeads in personal care products.",
    "Our app received mixed reviews after the latest update. Many users like the new dark mode and the faster "
    "search, but a large number complained that the redesigned menu hides the settings they use most often. Several "
    "reviewers also reported that notifications arrive late. The product team plans to restore a shortcut to the "
    "settings page and investigate the notification delays in the next release.",
    "The Romans built more than 80,000 kilometers of paved roads across their empire. The roads were made of several "
    "layers of stone and gravel, which made them durable and let water drain away. They helped armies move quickly, "
    "but they also made trade and travel easier for ordinary people. Some Roman roads are still in use today, and "
    "many modern highways follow their original routes.",
    "A study of more than 2,000 adults found that people who walked at least 7,000 steps a day had a lower risk of "
    "heart disease than those who walked fewer than 4,000. The benefits seemed to level off above about 10,000 steps. "
    "The researchers noted that the study shows an association rather than proof of cause, but said the results "
    "support the advice that any extra daily movement is worthwhile.",
    "In a six-month trial, sixty companies let their staff work four days a week with no cut in pay. Most companies "
    "reported that productivity stayed the same or improved, and employees said they felt less stressed and took "
    "fewer sick days. At the end of the trial, most of the companies decided to keep the four-day schedule, although "
    "some said it was harder to arrange for customer-facing teams.",
    "Octopuses are known for their intelligence. They can solve puzzles, open jars, and escape from aquarium tanks. "
    "Unlike humans, they have most of their neurons in their arms rather than in a central brain, so each arm can "
    "react to touch and taste somewhat independently. Octopuses can also change the color and texture of their skin "
    "in a fraction of a second to hide from predators.",
    "After the city added protected bike lanes on its main avenue, the number of cyclists on that street tripled "
    "within a year. Some shop owners worried that removing parking spaces would hurt their business, but a survey "
    "later showed that sales in the area rose slightly. The city now plans to build similar lanes on three more "
    "streets, starting next spring.",
]
PARAGRAPH_TEMPLATES = ["Summarize this paragraph in one sentence:\n\n{p}",
                       "Give me the main points of this text as three bullet points:\n\n{p}",
                       "Rewrite this paragraph so a ten-year-old can understand it:\n\n{p}",
                       "What is the main point of this passage, and what questions does it leave open?\n\n{p}",
                       "Write a catchy headline for this text:\n\n{p}"]

SENTENCES = ["hey, just wanted to check if u got my last message about the thing",
             "We need the report ASAP because the boss is super annoyed about it.",
             "The meeting got moved, so don't come at 3, come at 4 instead.",
             "Our product is really good and you should probably buy it.",
             "I can't make it to the party cuz something came up.",
             "The results of the experiment were not as good as what we were hoping they would be.",
             "Due to the fact that it was raining, the event was cancelled by the organizers.",
             "Sorry but your refund is not gonna happen because you waited too long.",
             "This software thing keeps crashing and it's driving everyone crazy.",
             "Please make sure that all of the forms are filled out completely before submitting them.",
             "In my opinion I think that we should maybe consider changing the plan.",
             "The new policy will impact employees in a way that could be negative for some of them."]
STYLES = ["more formal", "simpler and easier to read", "more concise", "warmer and friendlier", "more professional",
          "more persuasive"]
BROKEN = ["Me and him goes to the gym every mornings.",
          "Their going to announce the winners tomorrow, so be their early.",
          "She don't know nothing about the changes to the schedule.",
          "Each of the students have finished they're projects.",
          "I has been working here since three years.", "The informations you sent was very useful for we."]

PRODUCTS = ["a bike repair shop", "an electric toothbrush", "a family-run bakery", "a dog-walking service",
            "a language-learning app", "a school recycling campaign", "a plant-based burger", "a brand of hiking boots",
            "a used bookstore", "a coffee subscription", "a charity fun run", "a tutoring service",
            "a car-sharing app", "a yoga studio"]
PRODUCT_TEMPLATES = ["Come up with five slogans for {p}.", "Write a catchy tagline for {p}.",
                     "Suggest a name and a slogan for {p}."]
TITLED = ["a blog post about moving to a new country", "a podcast episode about personal finance for beginners",
          "a video review of cheap headphones", "a talk about accessibility in web design",
          "a children's book about a brave turtle", "a newsletter for a cycling club",
          "an article about the history of chess", "a workshop on public speaking", "a mystery novel set on a train",
          "a documentary about honeybees"]
DIALOGUES = ["a customer and a barista about a complicated coffee order",
             "a doctor and a patient about a cough that won't go away",
             "two astronauts repairing a solar panel on a space station",
             "a grandparent teaching a grandchild to fish", "a tourist asking a local for directions to a museum",
             "two roommates arguing about whose turn it is to do the dishes",
             "a detective and a nervous witness", "a teacher and a student who forgot their homework",
             "a shop assistant helping someone choose a gift", "two chess players after a long game",
             "a pilot and an air traffic controller on a stormy night"]
STORY_SUBJECTS = ["a painting that goes missing from a museum", "a bus driver's last shift before retiring",
                  "a cat who becomes mayor of a small town", "a soccer match in pouring rain", "a migrating whale",
                  "a bakery that only opens at midnight", "a lost passport", "the last tree in a desert town",
                  "a robot vacuum with big dreams", "a letter that arrives fifty years late",
                  "a mountain hut during a storm", "a street musician who plays one song"]
STORY_TEMPLATES = ["Write a sonnet about {s}.", "Write a short fable with a moral about {s}.",
                   "Write the opening paragraph of a mystery novel about {s}.", "Write a 50-word story about {s}.",
                   "Write a short scene, mostly dialogue, about {s}."]

BRAINSTORM = ["names for a golden retriever puppy", "themes for a tenth birthday party", "science fair project ideas",
              "cheap date night ideas", "team-building activities for a remote team", "ways to reuse glass jars",
              "gift ideas for someone who loves cooking", "questions to ask a new friend",
              "topics for a short persuasive essay", "ways to make a small bedroom feel bigger",
              "low-maintenance pets for an apartment", "podcast topics about local history",
              "snacks for a long hike", "ways a small business can find its first customers",
              "icebreaker games for a classroom", "names for a fantasy kingdom", "ideas for a community clean-up day",
              "themes for a photography project", "healthy lunches to bring to work",
              "creative uses for old T-shirts", "activities for a family reunion",
              "outdoor activities for a hot summer day", "ways to make a long commute more enjoyable",
              "conversation starters for a networking event", "plot twists for a detective story",
              "fundraising ideas for a school club", "hobbies that can be done at home",
              "ways to welcome a new coworker"]
COUNTS = ["three", "five", "seven", "ten"]
BRAINSTORM_TEMPLATES = ["List {n} {x}.", "Brainstorm {n} {x}.", "I need some {x}. Can you suggest {n}?",
                        "Give me {n} {x}, with a one-line description of each."]

REVIEWS = ["The delivery was fast, but the shoes fell apart after two weeks.",
           "Absolutely loved the hotel staff, they made our stay special.",
           "The film was fine. Nothing special, nothing terrible.",
           "I waited forty minutes on hold and nobody solved my problem.",
           "Best pizza in town, and the prices are fair too.",
           "The instructions were confusing, but support helped me set it up."]
REVIEW_TEMPLATES = ["Classify the sentiment of this review as positive, negative or mixed: \"{t}\"",
                    "Is this customer comment positive, negative or neutral? Explain briefly.\n\n\"{t}\""]
RECORDS = ["Hi Sara, can we meet on Friday, March 14 at 2:30 pm in room 204 to go over the first-quarter sales "
           "numbers? - Tom",
           "Order #48213 was shipped on June 3 to Maria Lopez, 12 Elm Street, Denver, and should arrive within five "
           "business days.",
           "Dr. Patel sees patients on Monday and Wednesday mornings from 8 to 12; call 555-0142 to book.",
           "The conference runs from 9 to 11 October in Lisbon, tickets cost 450 euros, and the early-bird deadline "
           "is 1 August.",
           "Invoice 2024-117: 3 hours of consulting at $120 per hour, plus $35 travel costs, due by the end of the "
           "month."]
RECORD_TEMPLATES = ["Extract all the dates, names and numbers from this text:\n\n{t}",
                    "Turn this text into a JSON object with sensible field names:\n\n{t}",
                    "List the key facts in this text as bullet points:\n\n{t}"]
HEADLINES = ["Local team wins championship after dramatic overtime",
             "Central bank raises interest rates for the third time this year",
             "New study links daily walking to better mood", "Tech company unveils foldable laptop",
             "City council approves plan for new public library", "Heat wave expected to break records this weekend"]
HEADLINE_TEMPLATE = ("Classify this headline into one of these categories: sports, business, health, technology, "
                     "politics, weather.\n\n\"{h}\"")
MESSAGES = ["Congratulations! You've won a free cruise. Click here to claim it now!",
            "Hi, are we still on for lunch tomorrow at noon?",
            "Your account will be suspended unless you verify your password at this link.",
            "Reminder: your dentist appointment is on Thursday at 10 am.",
            "Final notice: pay the attached invoice today to avoid legal action."]
MESSAGE_TEMPLATE = "Is this message likely to be spam? Explain why.\n\n\"{m}\""

PHRASES = ["Where is the nearest train station?", "Could I have the bill, please?", "I am allergic to peanuts.",
           "What time does the museum open?", "My name is Alex and I work as a nurse.",
           "Can you recommend a good restaurant nearby?", "I would like to book a room for two nights.",
           "How much does this jacket cost?", "Sorry, I don't understand. Could you speak more slowly?",
           "The bus was late this morning.", "We are going to the beach on Saturday.",
           "Do you have this shirt in a larger size?", "My phone battery is almost empty.",
           "It was nice to meet you.", "I need to see a doctor.", "Is breakfast included?",
           "Turn left at the second traffic light.", "I have been learning this language for six months.",
           "Happy birthday! I hope you have a wonderful day.", "Could you help me carry this bag?",
           "The meeting has been moved to Thursday.", "I lost my keys somewhere in the park.",
           "What do you recommend for dessert?", "Please close the window, it's cold."]
TARGETS = ["French", "Spanish", "German"]
PHRASE_TEMPLATES = ["Translate into {lang}: \"{s}\"", "How do you say \"{s}\" in {lang}?",
                    "Translate \"{s}\" into {lang} and explain any tricky words."]

ROLES = ["You are a patient math tutor. Explain long division using 756 divided by 6.",
         "Act as a travel guide and describe a perfect day in Lisbon.",
         "Pretend you are a park ranger and explain what to do if I meet a bear on a trail.",
         "You are a personal trainer. Design a 20-minute workout for a complete beginner.",
         "Act as a career coach and help me explain a one-year gap in my resume.",
         "You are a museum guide. Describe Van Gogh's Sunflowers to a group of visitors.",
         "Act as a nutritionist and suggest a balanced dinner for a busy weeknight.",
         "Pretend to be a medieval blacksmith and describe your typical working day.",
         "You are a librarian. Recommend three mystery novels for someone new to the genre.",
         "Act as a friendly IT helpdesk and explain how to reset a forgotten email password.",
         "You are a sports commentator. Describe the final seconds of a close basketball game.",
         "Act as a gardener and explain how to care for a lemon tree in a pot.",
         "You are a history teacher. Explain why the Roman Republic became an empire.",
         "Pretend you are a tour guide in Cairo and describe the Great Pyramid of Giza.",
         "Act as a chef and help me plan a three-course dinner for six guests.",
         "You are a financial advisor. Explain to a 25-year-old why it pays to start saving early.",
         "Act as a debate coach and give me arguments for and against school uniforms.",
         "You are a customer support agent. Reply to a customer whose package arrived damaged."]


def _word_problems(rng: random.Random, per_template: int = 5) -> list[str]:
    """Step-by-step word problems, each template filled with `per_template` sets of seeded numbers."""
    def one() -> list[str]:
        h, m, d = rng.randint(6, 20), rng.choice([0, 5, 15, 20, 35, 40, 50]), rng.randint(35, 190)
        a, b, c = rng.randint(2, 6), rng.choice([200, 250, 300, 450, 500]), rng.randint(7, 12)
        n, price = rng.randint(3, 9), rng.choice([1.25, 2.40, 3.75, 4.50, 0.85])
        bill = next(x for x in (10, 20, 50, 100) if x > n * price)
        w, l = rng.randint(3, 25), rng.randint(26, 60)
        cost, off = rng.choice([40, 65, 80, 120, 150, 240]), rng.choice([15, 20, 25, 30, 40])
        workers, hours, more = rng.randint(2, 5), rng.randint(6, 18), rng.randint(6, 9)
        v1, t1, v2, t2 = rng.randint(12, 25), rng.choice([1, 1.5, 2]), rng.randint(8, 20), rng.choice([0.5, 1, 2.5])
        money, rate, years = rng.choice([500, 1000, 2500, 4000]), rng.choice([2, 3, 4, 5]), rng.randint(3, 10)
        xa, xb = rng.randint(2, 9), rng.randint(1, 30)
        xc = xa * rng.randint(2, 12) + xb
        tank, flow = rng.choice([600, 900, 1200, 1500]), rng.choice([12, 15, 25, 40])
        vals = [rng.randint(50, 99) for _ in range(rng.randint(4, 6))]
        base, gb, extra = rng.choice([25, 30, 35, 45]), rng.choice([5, 8, 10]), rng.randint(2, 7)
        meal, friends, tip = rng.randint(60, 240), rng.randint(3, 8), rng.choice([10, 15, 18, 20])
        red, blue = rng.randint(3, 12), rng.randint(3, 12)
        part, whole = rng.randint(12, 90), rng.choice([120, 150, 200, 240, 400])
        return [f"A train leaves at {h}:{m:02d} and the trip takes {d} minutes. What time does it arrive? "
                "Show your reasoning.",
                f"A recipe for {a} people needs {b} grams of flour. How much flour do I need for {c} people? "
                "Explain step by step.",
                f"I bought {n} notebooks at ${price:.2f} each and paid with a ${bill} bill. How much change should "
                "I get?",
                f"A rectangular garden is {l} m long and {w} m wide. What are its area and perimeter? Show the steps.",
                f"A jacket costs ${cost} and is on sale for {off}% off. What is the sale price? Explain.",
                f"If {workers} workers can paint a fence in {hours} hours, how long would {more} workers take at "
                "the same rate? Show your work.",
                f"A cyclist rides at {v1} km/h for {t1:g} hours and then at {v2} km/h for {t2:g} hours. What are the "
                "total distance and the average speed?",
                f"I put ${money} in a savings account that earns {rate}% interest per year, compounded yearly. How "
                f"much will I have after {years} years? Show the calculation.",
                f"Solve for x: {xa}x + {xb} = {xc}. Show each step.",
                f"A water tank holds {tank} liters and fills at {flow} liters per minute. How long does it take to "
                "fill it from empty?",
                f"What is the mean of {', '.join(map(str, vals[:-1]))} and {vals[-1]}? Show how you get the answer.",
                f"A phone plan costs ${base} a month plus ${gb} for each extra gigabyte. If I use {extra} extra "
                "gigabytes, what is my bill for the month?",
                f"{friends} friends split a restaurant bill of ${meal} and add a {tip}% tip. How much does each "
                "person pay?",
                f"A bag has {red} red marbles and {blue} blue marbles. If I pick one at random, what is the "
                "probability that it is blue? Explain.",
                f"What percentage of {whole} is {part}? Show the steps."]
    return [p for _ in range(per_template) for p in one()]


def _pools() -> dict[str, tuple[bool, int, list[str]]]:
    """Category -> (is code, quota, candidate prompts)."""
    rng = random.Random(SEED)
    fmt = lambda: rng.choice(FORMATS)  # noqa: E731 (one format per combination keeps the pools balanced)
    fenced = lambda tag, code: _code(tag, code)  # noqa: E731
    return {
        "algorithms": (True, 130, [t.format(lang=lang, t=a) for t in ALGO_TEMPLATES for lang in LANGS
                                   for a in ALGOS]),
        "debugging": (True, 50, [t.format(lang=lang, intent=i, symptom=s, code=fenced(tag, c))
                                 for t in DEBUG_TEMPLATES for lang, tag, i, s, c in DEBUG]),
        "explain-code": (True, 40, [t.format(lang=lang, code=fenced(tag, c)) for t in SNIPPET_TEMPLATES
                                    for lang, tag, c in SNIPPETS]),
        "sql": (True, 40, [t.format(table=table, q=q) for t in SQL_TEMPLATES for table, qs in TABLES.items()
                           for q in qs]),
        "shell": (True, 40, [t.format(t=s) for t in SHELL_TEMPLATES for s in SHELL]
                  + [t.format(t=s) for t in SCRIPTING_TEMPLATES for s in SCRIPTING]),
        "regex": (True, 30, [t.format(r=r) for t in REGEX_TEMPLATES for r in REGEXES]
                  + [REGEX_LANG_TEMPLATE.format(lang=lang, r=r) for lang in REGEX_LANGS for r in REGEXES]),
        "unit-tests": (True, 35, [t.format(lang=lang, fw=fw, code=fenced(tag, c)) for t in TEST_TEMPLATES
                                  for lang, tag, fws, c in TESTED for fw in fws]),
        "refactoring": (True, 20, [t.format(lang=lang, code=fenced(tag, c)) for t in REFACTOR_TEMPLATES
                                   for lang, tag, c in REFACTOR]),
        "http-json": (True, 45, [t.format(lang=lang, t=a) for t in API_TEMPLATES for lang in API_LANGS
                                 for a in API_TASKS]),
        "dev-concepts": (True, 40, [t.format(c=c) for t in DEV_TEMPLATES for c in DEV_CONCEPTS]),
        "explanations": (False, 170, [t.format(x=x, fmt=fmt()) for t in TOPIC_TEMPLATES for x in TOPICS]),
        "questions": (False, 60, [q + s.format(fmt=fmt()) for s in QUESTION_SUFFIXES for q in QUESTIONS]),
        "facts": (False, 50, [t.format(q=q) for t in FACT_TEMPLATES for q in FACTS]),
        "how-to": (False, 100, [t.format(g=g, fmt=fmt()) for t in HOWTO_TEMPLATES for g in HOWTO]),
        "contrasts": (False, 30, [t.format(a=a, b=b) for t in CONTRAST_TEMPLATES for a, b in CONTRASTS]),
        "emails": (False, 40, [t.format(tone=rng.choice(EMAIL_TONES), r=r, s=s) for t in EMAIL_TEMPLATES
                               for r, s in EMAILS]),
        "summaries": (False, 25, [t.format(p=p) for t in PARAGRAPH_TEMPLATES for p in PARAGRAPHS]),
        "rewrites": (False, 30, [f"Rewrite this sentence so it is {style}: \"{s}\"" for style in STYLES
                                 for s in SENTENCES]
                     + [f"Fix the grammar in this sentence: \"{s}\"" for s in BROKEN]
                     + [f"Correct this sentence and explain each mistake: {s}" for s in BROKEN]),
        "creative": (False, 45, [t.format(p=p) for t in PRODUCT_TEMPLATES for p in PRODUCTS]
                     + [f"Suggest five titles for {x}." for x in TITLED]
                     + [f"Write a short dialogue between {d}." for d in DIALOGUES]
                     + [t.format(s=s) for t in STORY_TEMPLATES for s in STORY_SUBJECTS]),
        "brainstorm": (False, 45, [t.format(n=n, x=x) for t in BRAINSTORM_TEMPLATES for x in BRAINSTORM
                                   for n in COUNTS]),
        "word-problems": (False, 60, _word_problems(rng)),
        "classify-extract": (False, 40, [t.format(t=x) for t in REVIEW_TEMPLATES for x in REVIEWS]
                             + [t.format(t=x) for t in RECORD_TEMPLATES for x in RECORDS]
                             + [HEADLINE_TEMPLATE.format(h=h) for h in HEADLINES]
                             + [MESSAGE_TEMPLATE.format(m=m) for m in MESSAGES]),
        "translations": (False, 45, [t.format(lang=lang, s=s) for t in PHRASE_TEMPLATES for lang in TARGETS
                                     for s in PHRASES]),
        "roles": (False, 18, ROLES),
    }


def wide_prompts(existing: set[str]) -> tuple[list[str], int]:
    """The wide prompts, shuffled, and how many of them are code prompts. `existing`: prompts already in train.jsonl."""
    banned = existing | set(broad.held_out_prompts())
    rng = random.Random(SEED)
    picked, code, seen = [], 0, set(banned)
    for _name, (is_code, quota, candidates) in _pools().items():
        pool = [p for p in dict.fromkeys(candidates)
                if p not in seen and not any(w in p.lower() for w in broad.EXCLUDED)]
        chosen = rng.sample(pool, min(quota, len(pool)))
        seen.update(chosen)
        picked += chosen
        code += len(chosen) if is_code else 0
    rng.shuffle(picked)
    return picked, code


def main() -> None:
    prompts, code = wide_prompts(broad.earlier_prompts("wide-"))
    total = broad.write_part("wide-", SOURCE, prompts)
    print(f"{HERE / 'train.jsonl'}: {total} prompts ({len(prompts)} wide, {code} of them code)")


if __name__ == "__main__":
    main()
