/* The pod sandbox's process: it holds the pod's namespaces open and does nothing else. As PID 1 of the
 * pod's PID namespace it reaps whatever orphans reach it, and it exits at once on SIGTERM or SIGINT (a
 * PID 1 without handlers ignores them, and its sandbox would wait for SIGKILL). Built statically into an
 * image of its own by hack/build-node-images.sh: the containerd of the test node runs it for every pod. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void leave(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction stop = {.sa_handler = leave}, child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
    sigemptyset(&stop.sa_mask);
    sigemptyset(&child.sa_mask);
    if (sigaction(SIGINT, &stop, NULL) || sigaction(SIGTERM, &stop, NULL) || sigaction(SIGCHLD, &child, NULL))
        return 1;
    for (;;) pause();
}
