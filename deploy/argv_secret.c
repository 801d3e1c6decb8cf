/* Preloaded into tritonserver by deploy/server.py (LD_PRELOAD): before main() parses its arguments, every argument
 * holding the text named by SPECTREE_SECRET_MARK gets it replaced by the value of SPECTREE_SECRET (then both
 * variables and this library leave the environment, so the server's children never see them). tritonserver 2.51 reads
 * its restricted-API header value from the command line only; this way the admin token is in its argv array, not in
 * /proc/PID/cmdline, which every local user can read. glibc calls a preloaded library's constructors with
 * (argc, argv, envp), and main() receives that same argv array. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#define SECRET_ENV "SPECTREE_SECRET"
#define MARK_ENV "SPECTREE_SECRET_MARK"
#define SELF_ENV "SPECTREE_SECRET_PRELOAD"

static void drop_from_preload(const char *self) {
    const char *preload = getenv("LD_PRELOAD");
    if (!preload || !self || !*self) return;
    size_t n = strlen(preload), k = strlen(self);
    char *rest = malloc(n + 1);
    if (!rest) return;
    size_t out = 0;
    const char *p = preload;
    while (*p) {  /* entries separated by ':' or ' ' */
        size_t len = strcspn(p, ": ");
        if (!(len == k && strncmp(p, self, k) == 0)) {
            if (out) rest[out++] = ':';
            memcpy(rest + out, p, len);
            out += len;
        }
        p += len;
        if (*p) p++;
    }
    rest[out] = '\0';
    if (out) setenv("LD_PRELOAD", rest, 1); else unsetenv("LD_PRELOAD");
    free(rest);
}

__attribute__((constructor)) static void substitute(int argc, char **argv, char **envp) {
    (void)envp;
    const char *secret = getenv(SECRET_ENV);
    const char *mark = getenv(MARK_ENV);
    if (!secret || !mark || !*mark) return;
    size_t mark_len = strlen(mark), secret_len = strlen(secret);
    for (int i = 1; i < argc; i++) {
        char *at = strstr(argv[i], mark);
        if (!at) continue;
        size_t head = (size_t)(at - argv[i]);
        size_t tail = strlen(at + mark_len);
        char *arg = malloc(head + secret_len + tail + 1);
        if (!arg) abort();
        memcpy(arg, argv[i], head);
        memcpy(arg + head, secret, secret_len);
        memcpy(arg + head + secret_len, at + mark_len, tail + 1);
        argv[i] = arg;
    }
    drop_from_preload(getenv(SELF_ENV));
    unsetenv(SECRET_ENV);
    unsetenv(MARK_ENV);
    unsetenv(SELF_ENV);
}
