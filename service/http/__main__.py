from service.http.server import main

if __name__ == "__main__":  # importing the package's modules (tests, tools) must not start a server
    main()
